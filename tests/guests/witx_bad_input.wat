;; A hostile wasi-nn guest written against the raw witx ABI (wasi_ephemeral_nn): it makes
;; calls with bad arguments and prints each call's errno as one digit, in order.
(module
  (import "wasi_ephemeral_nn" "load" (func $load (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output" (func $get_output (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 4)
  (global $n (mut i32) (i32.const 0))
  (data (i32.const 0) "gpt2")
  (data (i32.const 8) "nope")
  ;; dims [1, 2]
  (data (i32.const 32) "\01\00\00\00\02\00\00\00")
  ;; tokens: valid [464, 3290], out of vocabulary [464, 99999], negative [-5, 1]
  (data (i32.const 48) "\d0\01\00\00\da\0c\00\00")
  (data (i32.const 56) "\d0\01\00\00\9f\86\01\00")
  (data (i32.const 64) "\fb\ff\ff\ff\01\00\00\00")
  ;; tensor records {dims_ptr, dims_len, type (u8, padded), data_ptr, data_len}
  (data (i32.const 80) "\20\00\00\00\02\00\00\00\04\00\00\00\30\00\00\00\08\00\00\00")  ;; valid I32
  (data (i32.const 100) "\20\00\00\00\02\00\00\00\01\00\00\00\30\00\00\00\08\00\00\00") ;; F32
  (data (i32.const 120) "\20\00\00\00\02\00\00\00\04\00\00\00\38\00\00\00\08\00\00\00") ;; id 99999
  (data (i32.const 140) "\20\00\00\00\02\00\00\00\04\00\00\00\40\00\00\00\08\00\00\00") ;; id -5
  ;; one graph builder of 8 garbage bytes
  (data (i32.const 200) "\dc\00\00\00\08\00\00\00")
  (data (i32.const 220) "garbage!")

  (func $report (param $errno i32)
    (i32.store8 (i32.add (i32.const 300) (global.get $n)) (i32.add (i32.const 48) (local.get $errno)))
    (global.set $n (i32.add (global.get $n) (i32.const 1))))

  (func (export "_start")
    (call $report (call $load_by_name (i32.const 8) (i32.const 4) (i32.const 16)))  ;; unknown name
    (call $report (call $load_by_name (i32.const 0) (i32.const 4) (i32.const 16)))  ;; gpt2
    (call $report (call $init (i32.load (i32.const 16)) (i32.const 20)))
    (call $report (call $compute (i32.load (i32.const 20))))                        ;; no input yet
    (call $report (call $set_input (i32.load (i32.const 20)) (i32.const 0) (i32.const 100))) ;; F32
    (call $report (call $set_input (i32.load (i32.const 20)) (i32.const 0) (i32.const 120))) ;; id >= vocab
    (call $report (call $set_input (i32.load (i32.const 20)) (i32.const 0) (i32.const 140))) ;; id < 0
    (call $report (call $set_input (i32.load (i32.const 20)) (i32.const 0) (i32.const 80)))  ;; valid
    (call $report (call $compute (i32.load (i32.const 20))))
    (call $report (call $get_output (i32.load (i32.const 20)) (i32.const 0) (i32.const 1024) (i32.const 16) (i32.const 24))) ;; buffer too small
    (call $report (call $get_output (i32.load (i32.const 20)) (i32.const 0) (i32.const 1024) (i32.const 201028) (i32.const 24)))
    (call $report (i32.ne (i32.load (i32.const 24)) (i32.const 201028)))           ;; 0: all logits came back
    (call $report (call $get_output (i32.load (i32.const 20)) (i32.const 4) (i32.const 1024) (i32.const 201028) (i32.const 24))) ;; no output 4
    (call $report (call $load (i32.const 200) (i32.const 1) (i32.const 5) (i32.const 0) (i32.const 16))) ;; garbage model bytes
    (call $report (call $compute (i32.load (i32.const 20))))                        ;; still serving
    (i32.store8 (i32.add (i32.const 300) (global.get $n)) (i32.const 10))
    (i32.store (i32.const 288) (i32.const 300))
    (i32.store (i32.const 292) (i32.add (global.get $n) (i32.const 1)))
    (drop (call $fd_write (i32.const 1) (i32.const 288) (i32.const 1) (i32.const 296)))))
