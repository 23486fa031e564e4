;; A guest that looks for what the guest before it in its pool slot wrote: it exits with 1 if
;; its image's byte at 1024 is not the image's ("i"), with 2 if the byte at 3 MiB (past the
;; image, zero at the start) is not 0; then it writes both, which the next guest in the slot
;; must not see (the pool resets a slot's memory however it keeps it resident).
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 64)
  (data (i32.const 1024) "i")
  (func (export "_start")
    (if (i32.ne (i32.load8_u (i32.const 1024)) (i32.const 105))
      (then (call $exit (i32.const 1))))
    (if (i32.ne (i32.load8_u (i32.const 3145728)) (i32.const 0))
      (then (call $exit (i32.const 2))))
    (i32.store8 (i32.const 1024) (i32.const 88))
    (i32.store8 (i32.const 3145728) (i32.const 7))
    (call $exit (i32.const 0))))
