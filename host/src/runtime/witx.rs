//! `wasi_ephemeral_nn`, wasi-nn's witx ABI for preview 1 modules, over our backend: our own
//! binding of its six functions instead of wasmtime-wasi-nn's (whose error conversion panics
//! on a guest pointer outside memory). Every pointer and length a guest passes is checked
//! against its memory (with overflow-checked arithmetic) before anything is read or written;
//! a bad one is `invalid-argument`. Backend errors carry the code that fits (a sequence past
//! the context or a full KV pool is `too-large`, an unknown name `not-found`, a malformed
//! tensor or model `invalid-argument`), and the host logs the reason. Graphs and contexts are
//! the instance's own and go with it.

use crate::wasi_nn::{backend_error_kind, ErrorKind, Gpt2Backend, Gpt2Error, GraphSet};
use std::collections::HashMap;
use wasmtime::{Caller, Extern, Linker};
use wasmtime_wasi_nn::backend::{BackendError, Id};
use wasmtime_wasi_nn::wit::{ExecutionTarget, TensorType};
use wasmtime_wasi_nn::{ExecutionContext, Graph, GraphRegistry, Tensor};

/// wasi-nn's witx error codes (`$nn_errno`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Errno {
    Success = 0,
    InvalidArgument = 1,
    InvalidEncoding = 2,
    MissingMemory = 3,
    Busy = 4,
    RuntimeError = 5,
    UnsupportedOperation = 6,
    TooLarge = 7,
    NotFound = 8,
}

/// Graphs and execution contexts one instance may hold at once (each context may hold a KV
/// cache; the pool caps their memory, this caps their number).
pub const MAX_HANDLES: usize = 1024;

/// One instance's wasi-nn state: the backend (for `load`), the preloaded graphs (for
/// `load_by_name`), and the handles it made.
pub struct WitxNn {
    backend: Gpt2Backend,
    named: GraphSet,
    graphs: HashMap<u32, Graph>,
    contexts: HashMap<u32, ExecutionContext>,
    next: u32,
}

type Outcome<T> = Result<T, Errno>;

impl From<ErrorKind> for Errno {
    fn from(kind: ErrorKind) -> Self {
        match kind {
            ErrorKind::InvalidArgument => Errno::InvalidArgument,
            ErrorKind::InvalidEncoding => Errno::InvalidEncoding,
            ErrorKind::TooLarge => Errno::TooLarge,
            ErrorKind::NotFound => Errno::NotFound,
            ErrorKind::UnsupportedOperation => Errno::UnsupportedOperation,
            ErrorKind::RuntimeError => Errno::RuntimeError,
        }
    }
}

/// The code that fits a backend error.
fn errno_of(e: &Gpt2Error) -> Errno {
    e.kind().into()
}

/// The code of an error that came back through wasmtime-wasi-nn's backend traits.
fn backend_errno(e: &BackendError) -> Errno {
    backend_error_kind(e).into()
}

impl WitxNn {
    pub fn new(backend: Gpt2Backend, named: GraphSet) -> Self {
        Self {
            backend,
            named,
            graphs: HashMap::new(),
            contexts: HashMap::new(),
            next: 0,
        }
    }

    fn handle(&mut self) -> Outcome<u32> {
        if self.graphs.len() + self.contexts.len() >= MAX_HANDLES {
            tracing::warn!("wasi-nn: an instance asked for more than {MAX_HANDLES} handles");
            return Err(Errno::Busy);
        }
        let handle = self.next;
        self.next = self.next.checked_add(1).ok_or(Errno::Busy)?;
        Ok(handle)
    }

    fn add_graph(&mut self, graph: Graph) -> Outcome<u32> {
        let handle = self.handle()?;
        self.graphs.insert(handle, graph);
        Ok(handle)
    }

    fn context(&mut self, handle: u32) -> Outcome<&mut ExecutionContext> {
        self.contexts.get_mut(&handle).ok_or(Errno::InvalidArgument)
    }
}

/// `[at, at + len)` of `memory`, or `invalid-argument`.
fn span(memory: &[u8], at: u32, len: u64) -> Outcome<std::ops::Range<usize>> {
    let start = at as u64;
    let end = start.checked_add(len).ok_or(Errno::InvalidArgument)?;
    if end > memory.len() as u64 {
        return Err(Errno::InvalidArgument);
    }
    Ok(start as usize..end as usize)
}

fn read_u32(memory: &[u8], at: u32) -> Outcome<u32> {
    let r = span(memory, at, 4)?;
    let b = &memory[r];
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn write_u32(memory: &mut [u8], at: u32, value: u32) -> Outcome<()> {
    let r = span(memory, at, 4)?;
    memory[r].copy_from_slice(&value.to_le_bytes());
    Ok(())
}

/// A `(pointer, length)` pair at `at` naming `len * size` bytes.
fn list(memory: &[u8], at: u32, size: u64) -> Outcome<std::ops::Range<usize>> {
    let ptr = read_u32(memory, at)?;
    let len = read_u32(memory, at.checked_add(4).ok_or(Errno::InvalidArgument)?)?;
    span(memory, ptr, len as u64 * size)
}

fn tensor_type(tag: u8) -> Outcome<TensorType> {
    Ok(match tag {
        0 => TensorType::Fp16,
        1 => TensorType::Fp32,
        2 => TensorType::Fp64,
        3 => TensorType::U8,
        4 => TensorType::I32,
        5 => TensorType::I64,
        _ => return Err(Errno::InvalidArgument),
    })
}

fn target(tag: i32) -> Outcome<ExecutionTarget> {
    Ok(match tag {
        0 => ExecutionTarget::Cpu,
        1 => ExecutionTarget::Gpu,
        2 => ExecutionTarget::Tpu,
        _ => return Err(Errno::InvalidArgument),
    })
}

/// The encoding tag of `autodetect`, the one our backend registers.
const AUTODETECT: i32 = 5;

/// Run `f` over the caller's memory and its wasi-nn state; any error is its code.
fn with_memory<T>(
    caller: &mut Caller<'_, T>,
    get: fn(&mut T) -> &mut WitxNn,
    f: impl FnOnce(&mut [u8], &mut WitxNn) -> Outcome<()>,
) -> i32 {
    let Some(Extern::Memory(memory)) = caller.get_export("memory") else {
        return Errno::MissingMemory as i32;
    };
    let (bytes, state) = memory.data_and_store_mut(caller);
    match f(bytes, get(state)) {
        Ok(()) => Errno::Success as i32,
        Err(code) => code as i32,
    }
}

/// Add `wasi_ephemeral_nn` to `linker`; `get` finds an instance's [`WitxNn`].
pub fn add_to_linker<T: 'static>(
    linker: &mut Linker<T>,
    get: fn(&mut T) -> &mut WitxNn,
) -> wasmtime::Result<()> {
    const M: &str = "wasi_ephemeral_nn";
    linker.func_wrap(
        M,
        "load",
        move |mut caller: Caller<'_, T>,
              builders: u32,
              count: u32,
              encoding: i32,
              target_tag: i32,
              result: u32|
              -> i32 {
            with_memory(&mut caller, get, |memory, nn| {
                if encoding != AUTODETECT {
                    return Err(Errno::InvalidEncoding);
                }
                let target = target(target_tag)?;
                let entries = span(memory, builders, count as u64 * 8)?;
                let mut parts = Vec::with_capacity(count as usize);
                for i in 0..count {
                    let at = entries.start as u32 + i * 8;
                    parts.push(list(memory, at, 1)?);
                }
                span(memory, result, 4)?;
                let slices: Vec<&[u8]> = parts.iter().map(|r| &memory[r.clone()]).collect();
                let graph = nn.backend.load_bytes(&slices, target).map_err(|e| {
                    tracing::warn!("wasi-nn load: {e}");
                    errno_of(&e)
                })?;
                let handle = nn.add_graph(graph)?;
                write_u32(memory, result, handle)
            })
        },
    )?;
    linker.func_wrap(
        M,
        "load_by_name",
        move |mut caller: Caller<'_, T>, name: u32, len: u32, result: u32| -> i32 {
            with_memory(&mut caller, get, |memory, nn| {
                let r = span(memory, name, len as u64)?;
                let name = std::str::from_utf8(&memory[r]).map_err(|_| Errno::InvalidArgument)?;
                let graph = match nn.named.get(name) {
                    Some(graph) => graph.clone(),
                    None => {
                        tracing::warn!("wasi-nn (NotFound): no graph named `{name}`");
                        return Err(Errno::NotFound);
                    }
                };
                span(memory, result, 4)?;
                let handle = nn.add_graph(graph)?;
                write_u32(memory, result, handle)
            })
        },
    )?;
    linker.func_wrap(
        M,
        "init_execution_context",
        move |mut caller: Caller<'_, T>, graph: u32, result: u32| -> i32 {
            with_memory(&mut caller, get, |memory, nn| {
                span(memory, result, 4)?;
                let graph = nn.graphs.get(&graph).ok_or(Errno::InvalidArgument)?;
                let context = graph
                    .init_execution_context()
                    .map_err(|e| backend_errno(&e))?;
                let handle = nn.handle()?;
                nn.contexts.insert(handle, context);
                write_u32(memory, result, handle)
            })
        },
    )?;
    linker.func_wrap(
        M,
        "set_input",
        move |mut caller: Caller<'_, T>, context: u32, index: u32, tensor: u32| -> i32 {
            with_memory(&mut caller, get, |memory, nn| {
                // $tensor: dimensions (pointer, length) at 0, type (u8) at 8, data at 12
                let record = span(memory, tensor, 20)?;
                let at = record.start as u32;
                let dims = list(memory, at, 4)?;
                let ty = tensor_type(memory[record.start + 8])?;
                let data = list(memory, at + 12, 1)?;
                let tensor = Tensor {
                    dimensions: memory[dims]
                        .chunks_exact(4)
                        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                    ty,
                    data: memory[data].to_vec(),
                };
                nn.context(context)?
                    .set_input(Id::Index(index), &tensor)
                    .map_err(|e| backend_errno(&e))
            })
        },
    )?;
    linker.func_wrap(
        M,
        "compute",
        move |mut caller: Caller<'_, T>, context: u32| -> i32 {
            with_memory(&mut caller, get, |_, nn| {
                nn.context(context)?
                    .compute()
                    .map_err(|e| backend_errno(&e))
            })
        },
    )?;
    linker.func_wrap(
        M,
        "get_output",
        move |mut caller: Caller<'_, T>,
              context: u32,
              index: u32,
              out: u32,
              max: u32,
              result: u32|
              -> i32 {
            with_memory(&mut caller, get, |memory, nn| {
                let destination = span(memory, out, max as u64)?;
                span(memory, result, 4)?;
                let tensor = nn
                    .context(context)?
                    .get_output(Id::Index(index))
                    .map_err(|e| backend_errno(&e))?;
                let n = tensor.data.len();
                if n > destination.len() {
                    return Err(Errno::TooLarge);
                }
                memory[destination.start..destination.start + n].copy_from_slice(&tensor.data);
                write_u32(memory, result, n as u32)
            })
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_reject_what_memory_does_not_hold() {
        let memory = [0u8; 64];
        assert_eq!(span(&memory, 60, 4), Ok(60..64));
        assert_eq!(span(&memory, 61, 4), Err(Errno::InvalidArgument));
        assert_eq!(span(&memory, u32::MAX, 1), Err(Errno::InvalidArgument));
        assert_eq!(span(&memory, 0, u64::MAX), Err(Errno::InvalidArgument));
        // a list of u32::MAX elements of 8 bytes: no overflow, just too large
        let mut memory = [0u8; 16];
        memory[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(list(&memory, 0, 8), Err(Errno::InvalidArgument));
        assert_eq!(list(&memory, 12, 1), Err(Errno::InvalidArgument));
        assert_eq!(tensor_type(6), Err(Errno::InvalidArgument));
        assert_eq!(target(3), Err(Errno::InvalidArgument));
    }
}
