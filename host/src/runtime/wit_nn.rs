//! `wasi:nn` for components (WIT, `wit/deps/wasi-nn`) over our backend: our own host of its
//! four interfaces instead of wasmtime-wasi-nn's, for the same reasons as the witx binding
//! ([`super::witx`]): every backend error reaches the guest with the code that fits
//! (`too-large` for a sequence past the context or a full KV pool, `not-found` for an unknown
//! name, `invalid-argument` for a malformed tensor or model, `unsupported-operation` for a
//! target we do not run on) and a message in `error.data`, where wasmtime-wasi-nn's gives
//! every failure as `runtime-error`; and an instance cannot make the host hold without bound
//! what it creates: at most [`MAX_RESOURCES`] graphs, contexts, tensors and errors live at
//! once, their tensors at most [`MAX_TENSOR_BYTES`]. A tensor over either limit traps the
//! instance (a constructor has no error to return); a `compute` whose outputs would pass them
//! is a `too-large` error.
//!
//! Handles are checked by the component model itself: an index the instance does not hold
//! traps that instance before any of this runs, and one instance's resources are not
//! reachable from another.

use crate::wasi_nn::{backend_error_kind, backend_error_message, ErrorKind, Gpt2Backend, GraphSet};
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi_nn::backend::NamedTensor as BackendTensor;
use wasmtime_wasi_nn::{ExecutionContext, Graph, GraphRegistry};

mod generated {
    wasmtime::component::bindgen!({
        world: "wasi:nn/ml",
        path: "../wit/deps/wasi-nn",
        with: {
            "wasi:nn/graph.graph": wasmtime_wasi_nn::Graph,
            "wasi:nn/tensor.tensor": super::WitTensor,
            "wasi:nn/inference.graph-execution-context": wasmtime_wasi_nn::ExecutionContext,
            "wasi:nn/errors.error": super::NnError,
        },
        imports: { default: trappable },
    });
}

use generated::wasi::nn::{errors, graph, inference, tensor};
use tensor::TensorType;

/// Resources (graphs, contexts, tensors, errors) one instance may hold at once.
pub const MAX_RESOURCES: usize = 4096;

/// Bytes of tensor data one instance may hold at once (its own tensors and the outputs it
/// has not dropped): a 1558M model's logits for a whole 1024-token context are 206 MB.
pub const MAX_TENSOR_BYTES: usize = 1 << 30;

/// A tensor as the guest made it or a `compute` returned it.
pub struct WitTensor {
    dimensions: Vec<u32>,
    ty: TensorType,
    data: Vec<u8>,
}

/// A wasi-nn error as the guest sees it: its code and what went wrong.
pub struct NnError {
    code: errors::ErrorCode,
    message: String,
}

impl NnError {
    fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        let code = match kind {
            ErrorKind::InvalidArgument => errors::ErrorCode::InvalidArgument,
            ErrorKind::InvalidEncoding => errors::ErrorCode::InvalidEncoding,
            ErrorKind::TooLarge => errors::ErrorCode::TooLarge,
            ErrorKind::NotFound => errors::ErrorCode::NotFound,
            ErrorKind::UnsupportedOperation => errors::ErrorCode::UnsupportedOperation,
            ErrorKind::RuntimeError => errors::ErrorCode::RuntimeError,
        };
        let message = message.into();
        tracing::warn!("wasi-nn ({code:?}): {message}");
        Self { code, message }
    }
}

/// One instance's `wasi:nn` state: the backend (for `load`), the preloaded graphs (for
/// `load-by-name`) and what it holds now. Its resources live in the instance's
/// [`ResourceTable`] and go with it.
pub struct WitNn {
    backend: Gpt2Backend,
    named: GraphSet,
    resources: usize,
    tensor_bytes: usize,
}

impl WitNn {
    pub fn new(backend: Gpt2Backend, named: GraphSet) -> Self {
        Self {
            backend,
            named,
            resources: 0,
            tensor_bytes: 0,
        }
    }
}

/// What the bindings see of an instance: its table and its [`WitNn`].
pub struct WitNnView<'a> {
    table: &'a mut ResourceTable,
    nn: &'a mut WitNn,
}

impl<'a> WitNnView<'a> {
    pub fn new(table: &'a mut ResourceTable, nn: &'a mut WitNn) -> Self {
        Self { table, nn }
    }

    /// Room for `count` more resources holding `bytes` of tensor data, or the limit passed.
    fn room(&self, count: usize, bytes: usize) -> Result<(), String> {
        if self.nn.resources + count > MAX_RESOURCES {
            return Err(format!(
                "an instance may hold at most {MAX_RESOURCES} wasi-nn resources at once \
                 (graphs, contexts, tensors, errors); drop some first"
            ));
        }
        if self.nn.tensor_bytes.saturating_add(bytes) > MAX_TENSOR_BYTES {
            return Err(format!(
                "an instance may hold at most {MAX_TENSOR_BYTES} bytes of wasi-nn tensors at \
                 once; it holds {} and asked for {bytes} more",
                self.nn.tensor_bytes
            ));
        }
        Ok(())
    }

    /// Push a resource counted against the instance's limits (which the caller checked).
    fn push<T: Send + 'static>(&mut self, value: T, bytes: usize) -> wasmtime::Result<Resource<T>> {
        let resource = self.table.push(value)?;
        self.nn.resources += 1;
        self.nn.tensor_bytes += bytes;
        Ok(resource)
    }

    fn delete<T: 'static>(&mut self, resource: Resource<T>) -> wasmtime::Result<T> {
        let value = self.table.delete(resource)?;
        self.nn.resources = self.nn.resources.saturating_sub(1);
        Ok(value)
    }

    fn delete_tensor(&mut self, tensor: Resource<WitTensor>) -> wasmtime::Result<WitTensor> {
        let tensor = self.delete(tensor)?;
        self.nn.tensor_bytes = self.nn.tensor_bytes.saturating_sub(tensor.data.len());
        Ok(tensor)
    }

    /// An error for the guest; over the resource limit, the instance traps instead.
    fn error<T>(
        &mut self,
        kind: ErrorKind,
        message: impl Into<String>,
    ) -> wasmtime::Result<Result<T, Resource<NnError>>> {
        let error = NnError::new(kind, message);
        self.room(1, 0).map_err(wasmtime::Error::msg)?;
        Ok(Err(self.push(error, 0)?))
    }

    fn add_graph(
        &mut self,
        graph: Graph,
    ) -> wasmtime::Result<Result<Resource<Graph>, Resource<NnError>>> {
        if let Err(message) = self.room(1, 0) {
            return self.error(ErrorKind::TooLarge, message);
        }
        Ok(Ok(self.push(graph, 0)?))
    }
}

struct HasWitNn;

impl HasData for HasWitNn {
    type Data<'a> = WitNnView<'a>;
}

/// Add `wasi:nn` to a component `linker`; `get` finds an instance's view.
pub fn add_to_linker<T: 'static>(
    linker: &mut Linker<T>,
    get: fn(&mut T) -> WitNnView<'_>,
) -> wasmtime::Result<()> {
    graph::add_to_linker::<_, HasWitNn>(linker, get)?;
    tensor::add_to_linker::<_, HasWitNn>(linker, get)?;
    inference::add_to_linker::<_, HasWitNn>(linker, get)?;
    errors::add_to_linker::<_, HasWitNn>(linker, get)?;
    Ok(())
}

fn backend_type(ty: TensorType) -> wasmtime_wasi_nn::wit::TensorType {
    use wasmtime_wasi_nn::wit::TensorType as B;
    match ty {
        TensorType::Fp16 => B::Fp16,
        TensorType::Fp32 => B::Fp32,
        TensorType::Fp64 => B::Fp64,
        TensorType::Bf16 => B::Bf16,
        TensorType::U8 => B::U8,
        TensorType::I32 => B::I32,
        TensorType::I64 => B::I64,
    }
}

fn wit_type(ty: wasmtime_wasi_nn::wit::TensorType) -> TensorType {
    use wasmtime_wasi_nn::wit::TensorType as B;
    match ty {
        B::Fp16 => TensorType::Fp16,
        B::Fp32 => TensorType::Fp32,
        B::Fp64 => TensorType::Fp64,
        B::Bf16 => TensorType::Bf16,
        B::U8 => TensorType::U8,
        B::I32 => TensorType::I32,
        B::I64 => TensorType::I64,
    }
}

impl graph::Host for WitNnView<'_> {
    fn load(
        &mut self,
        builders: Vec<Vec<u8>>,
        encoding: graph::GraphEncoding,
        target: graph::ExecutionTarget,
    ) -> wasmtime::Result<Result<Resource<Graph>, Resource<NnError>>> {
        if encoding != graph::GraphEncoding::Autodetect {
            return self.error(
                ErrorKind::InvalidEncoding,
                format!("encoding {encoding:?}: this backend loads `autodetect` (GPT-2 safetensors + config.json, or llm.c)"),
            );
        }
        let target = match target {
            graph::ExecutionTarget::Cpu => wasmtime_wasi_nn::wit::ExecutionTarget::Cpu,
            graph::ExecutionTarget::Gpu => wasmtime_wasi_nn::wit::ExecutionTarget::Gpu,
            graph::ExecutionTarget::Tpu => wasmtime_wasi_nn::wit::ExecutionTarget::Tpu,
        };
        let slices: Vec<&[u8]> = builders.iter().map(Vec::as_slice).collect();
        match self.nn.backend.load_bytes(&slices, target) {
            Ok(graph) => self.add_graph(graph),
            Err(e) => self.error(e.kind(), e.to_string()),
        }
    }

    fn load_by_name(
        &mut self,
        name: String,
    ) -> wasmtime::Result<Result<Resource<Graph>, Resource<NnError>>> {
        match self.nn.named.get(&name) {
            Some(graph) => {
                let graph = graph.clone();
                self.add_graph(graph)
            }
            None => {
                let known: Vec<&str> = self.nn.named.names().collect();
                let message = format!("no graph named `{name}` (this host has {known:?})");
                self.error(ErrorKind::NotFound, message)
            }
        }
    }
}

impl graph::HostGraph for WitNnView<'_> {
    fn init_execution_context(
        &mut self,
        graph: Resource<Graph>,
    ) -> wasmtime::Result<Result<Resource<ExecutionContext>, Resource<NnError>>> {
        if let Err(message) = self.room(1, 0) {
            return self.error(ErrorKind::TooLarge, message);
        }
        let context = self.table.get(&graph)?.init_execution_context();
        match context {
            Ok(context) => Ok(Ok(self.push(context, 0)?)),
            Err(e) => self.error(backend_error_kind(&e), backend_error_message(&e)),
        }
    }

    fn drop(&mut self, graph: Resource<Graph>) -> wasmtime::Result<()> {
        self.delete(graph).map(drop)
    }
}

impl inference::Host for WitNnView<'_> {}

impl inference::HostGraphExecutionContext for WitNnView<'_> {
    fn compute(
        &mut self,
        context: Resource<ExecutionContext>,
        inputs: Vec<(String, Resource<WitTensor>)>,
    ) -> wasmtime::Result<Result<Vec<(String, Resource<WitTensor>)>, Resource<NnError>>> {
        // The inputs are owned handles: they pass to the host and are gone from the guest.
        let mut named = Vec::with_capacity(inputs.len());
        for (name, tensor) in inputs {
            let tensor = self.delete_tensor(tensor)?;
            named.push(BackendTensor {
                name,
                tensor: wasmtime_wasi_nn::Tensor::new(
                    tensor.dimensions,
                    backend_type(tensor.ty),
                    tensor.data,
                ),
            });
        }
        let outputs = self.table.get_mut(&context)?.compute_with_io(named);
        let outputs = match outputs {
            Ok(outputs) => outputs,
            Err(e) => return self.error(backend_error_kind(&e), backend_error_message(&e)),
        };
        let bytes: usize = outputs.iter().map(|t| t.tensor.data.len()).sum();
        if let Err(message) = self.room(outputs.len(), bytes) {
            return self.error(ErrorKind::TooLarge, message);
        }
        let mut result = Vec::with_capacity(outputs.len());
        for BackendTensor { name, tensor } in outputs {
            let bytes = tensor.data.len();
            let tensor = WitTensor {
                dimensions: tensor.dimensions,
                ty: wit_type(tensor.ty),
                data: tensor.data,
            };
            result.push((name, self.push(tensor, bytes)?));
        }
        Ok(Ok(result))
    }

    fn drop(&mut self, context: Resource<ExecutionContext>) -> wasmtime::Result<()> {
        self.delete(context).map(drop)
    }
}

impl tensor::Host for WitNnView<'_> {}

impl tensor::HostTensor for WitNnView<'_> {
    fn new(
        &mut self,
        dimensions: Vec<u32>,
        ty: TensorType,
        data: Vec<u8>,
    ) -> wasmtime::Result<Resource<WitTensor>> {
        let bytes = data.len();
        self.room(1, bytes).map_err(wasmtime::Error::msg)?;
        let tensor = WitTensor {
            dimensions,
            ty,
            data,
        };
        self.push(tensor, bytes)
    }

    fn dimensions(&mut self, tensor: Resource<WitTensor>) -> wasmtime::Result<Vec<u32>> {
        Ok(self.table.get(&tensor)?.dimensions.clone())
    }

    fn ty(&mut self, tensor: Resource<WitTensor>) -> wasmtime::Result<TensorType> {
        Ok(self.table.get(&tensor)?.ty)
    }

    fn data(&mut self, tensor: Resource<WitTensor>) -> wasmtime::Result<Vec<u8>> {
        Ok(self.table.get(&tensor)?.data.clone())
    }

    fn drop(&mut self, tensor: Resource<WitTensor>) -> wasmtime::Result<()> {
        self.delete_tensor(tensor).map(drop)
    }
}

impl errors::Host for WitNnView<'_> {}

impl errors::HostError for WitNnView<'_> {
    fn code(&mut self, error: Resource<NnError>) -> wasmtime::Result<errors::ErrorCode> {
        Ok(self.table.get(&error)?.code)
    }

    fn data(&mut self, error: Resource<NnError>) -> wasmtime::Result<String> {
        Ok(self.table.get(&error)?.message.clone())
    }

    fn drop(&mut self, error: Resource<NnError>) -> wasmtime::Result<()> {
        self.delete(error).map(drop)
    }
}
