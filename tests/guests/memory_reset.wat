;; A guest that looks for what the guest before it in its pool slot wrote: it exits with 1 if
;; its image's byte at 1024 is not the image's ("i"), with 2 if the byte at 3 MiB (past the
;; image, zero at the start) is not 0, with 3 if its table's entry 1 (empty at the start) is
;; set, with 4 if entry 0 (the image's element) is not; then it writes the two bytes and
;; entry 1, which the next guest in the slot must not see (the pool resets a slot's memory
;; and tables however it keeps them resident).
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 64)
  (data (i32.const 1024) "i")
  (table $t 4 funcref)
  (elem (i32.const 0) func $mark)
  (func $mark)
  (func (export "_start")
    (if (i32.ne (i32.load8_u (i32.const 1024)) (i32.const 105))
      (then (call $exit (i32.const 1))))
    (if (i32.ne (i32.load8_u (i32.const 3145728)) (i32.const 0))
      (then (call $exit (i32.const 2))))
    (if (i32.eqz (ref.is_null (table.get $t (i32.const 1))))
      (then (call $exit (i32.const 3))))
    (if (ref.is_null (table.get $t (i32.const 0)))
      (then (call $exit (i32.const 4))))
    (i32.store8 (i32.const 1024) (i32.const 88))
    (i32.store8 (i32.const 3145728) (i32.const 7))
    (table.set $t (i32.const 1) (ref.func $mark))
    (call $exit (i32.const 0))))
