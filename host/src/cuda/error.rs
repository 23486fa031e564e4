//! The CUDA backend's error: the driver's, NVRTC's and cuBLAS's own error types kept typed
//! (out-of-memory is the driver's result code, never a matched string), turned into the
//! engine's error at the backend's edge.

use crate::engine::EngineError;
use cudarc::driver::sys::CUresult;
use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A driver call failed while doing `what`.
    #[error("{what}: {source}")]
    Driver {
        what: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("NVRTC failed to compile the kernels: {0}")]
    Compile(#[from] cudarc::nvrtc::CompileError),
    #[error("cuBLAS: {0}")]
    Cublas(#[from] cudarc::cublas::result::CublasError),
    #[error("cuBLASLt: {0}")]
    CublasLt(#[from] cudarc::cublaslt::result::CublasError),
    #[error("{path}: {source}")]
    KernelFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A launch whose buffers are smaller than what the kernel would touch: refused.
    #[error("{0}: a buffer is smaller than the launch would touch")]
    Bounds(&'static str),
    /// A library or device the backend needs is missing, or the model does not fit the
    /// kernels (the message says which).
    #[error("{0}")]
    Unavailable(String),
}

/// `Err(Bounds(what))` unless `fits`: the launchers' size checks.
pub(crate) fn ensure(fits: bool, what: &'static str) -> Result<(), CudaError> {
    if fits {
        Ok(())
    } else {
        Err(CudaError::Bounds(what))
    }
}

impl From<DriverError> for CudaError {
    fn from(source: DriverError) -> Self {
        CudaError::Driver {
            what: "CUDA driver call",
            source,
        }
    }
}

impl CudaError {
    pub(crate) fn unavailable(message: impl Into<String>) -> Self {
        CudaError::Unavailable(message.into())
    }

    /// Whether the device ran out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, CudaError::Driver { source, .. } if source.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    }
}

/// `.ctx("what")` on a driver result: the failure names what was being done.
pub(crate) trait DriverContext<T> {
    fn ctx(self, what: &'static str) -> Result<T, CudaError>;
}

impl<T> DriverContext<T> for Result<T, DriverError> {
    fn ctx(self, what: &'static str) -> Result<T, CudaError> {
        self.map_err(|source| CudaError::Driver { what, source })
    }
}

impl From<CudaError> for EngineError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Driver { what, .. } if e.is_out_of_memory() => EngineError::OutOfMemory {
                what: what.to_owned(),
            },
            e => EngineError::Device(Box::new(e)),
        }
    }
}
