;; A guest that hands wasi-nn pointers and lengths outside its memory (one 64 KiB page) in
;; every function; each call's errno is printed as a digit, then a newline. None may panic
;; the host; the well-formed calls at the end still work.
(module
  (import "wasi_ephemeral_nn" "load" (func $load (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output" (func $get_output (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (global $n (mut i32) (i32.const 0))
  (data (i32.const 0) "gpt2")
  (data (i32.const 32) "\01\00\00\00\02\00\00\00")
  (data (i32.const 48) "\d0\01\00\00\da\0c\00\00")
  ;; a valid I32 [1, 2] tensor
  (data (i32.const 80) "\20\00\00\00\02\00\00\00\04\00\00\00\30\00\00\00\08\00\00\00")
  ;; dimensions at 0xfffffff0
  (data (i32.const 160) "\f0\ff\ff\ff\02\00\00\00\04\00\00\00\30\00\00\00\08\00\00\00")
  ;; data of 0x7fffffff bytes
  (data (i32.const 180) "\20\00\00\00\02\00\00\00\04\00\00\00\30\00\00\00\ff\ff\ff\7f")
  ;; a graph builder claiming 4 GiB
  (data (i32.const 200) "\00\00\00\00\ff\ff\ff\ff")

  (func $report (param $errno i32)
    (i32.store8 (i32.add (i32.const 300) (global.get $n)) (i32.add (i32.const 48) (local.get $errno)))
    (global.set $n (i32.add (global.get $n) (i32.const 1))))

  (func (export "_start")
    (call $report (call $load_by_name (i32.const 65534) (i32.const 4) (i32.const 16)))  ;; name outside
    (call $report (call $load_by_name (i32.const 0) (i32.const 4) (i32.const 65534)))   ;; result outside
    (call $report (call $load_by_name (i32.const 0) (i32.const 4) (i32.const 16)))      ;; ok
    (call $report (call $init (i32.load (i32.const 16)) (i32.const 65534)))             ;; result outside
    (call $report (call $init (i32.load (i32.const 16)) (i32.const 20)))                ;; ok
    (call $report (call $set_input (i32.load (i32.const 20)) (i32.const 0) (i32.const 65530))) ;; record outside
    (call $report (call $set_input (i32.load (i32.const 20)) (i32.const 0) (i32.const 160)))   ;; dims outside
    (call $report (call $set_input (i32.load (i32.const 20)) (i32.const 0) (i32.const 180)))   ;; data outside
    (call $report (call $get_output (i32.load (i32.const 20)) (i32.const 0) (i32.const 65000) (i32.const 100000) (i32.const 24))) ;; buffer outside
    (call $report (call $load (i32.const 65530) (i32.const 2) (i32.const 5) (i32.const 0) (i32.const 16)))      ;; builders outside
    (call $report (call $load (i32.const 200) (i32.const 1) (i32.const 5) (i32.const 0) (i32.const 16)))        ;; 4 GiB claimed
    (call $report (call $load (i32.const 0) (i32.const 0x20000000) (i32.const 5) (i32.const 0) (i32.const 16))) ;; 2^29 builders
    (call $report (call $set_input (i32.load (i32.const 20)) (i32.const 0) (i32.const 80)))    ;; ok
    (call $report (call $compute (i32.load (i32.const 20))))                                   ;; ok
    (call $report (call $get_output (i32.load (i32.const 20)) (i32.const 2) (i32.const 1024) (i32.const 4) (i32.const 24))) ;; ok
    (i32.store8 (i32.add (i32.const 300) (global.get $n)) (i32.const 10))
    (i32.store (i32.const 288) (i32.const 300))
    (i32.store (i32.const 292) (i32.add (global.get $n) (i32.const 1)))
    (drop (call $fd_write (i32.const 1) (i32.const 288) (i32.const 1) (i32.const 296)))))
