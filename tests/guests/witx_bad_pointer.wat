;; A guest that hands wasi-nn a tensor whose dimensions point outside its memory.
(module
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "gpt2")
  (data (i32.const 48) "\d0\01\00\00\da\0c\00\00")
  (data (i32.const 160) "\f0\ff\ff\ff\02\00\00\00\04\00\00\00\30\00\00\00\08\00\00\00")
  (func (export "_start")
    (drop (call $load_by_name (i32.const 0) (i32.const 4) (i32.const 16)))
    (drop (call $init (i32.load (i32.const 16)) (i32.const 20)))
    (drop (call $set_input (i32.load (i32.const 20)) (i32.const 0) (i32.const 160)))))
