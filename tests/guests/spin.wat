;; A guest that never stops: `_start` loops forever (the fuel and time limits' test).
(module
  (memory (export "memory") 1)
  (func (export "_start")
    (loop $forever
      (br $forever))))
