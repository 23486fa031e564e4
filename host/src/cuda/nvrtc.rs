//! The kernels' source and its compilation: every `.cu` file of `kernels/` (built into the
//! binary) pasted into one translation unit, compiled with NVRTC for the GPU at hand with the
//! constants both sides share handed over as `-D` defines (the caller's), and the PTX cached
//! on disk by a hash of source, defines and architecture.

use super::error::CudaError;
use std::path::Path;

/// Constants handed to the kernels as `-D NAME=value`.
pub type Defines = [(&'static str, u32)];

const KERNEL_SOURCES: [(&str, &str); 8] = [
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    (
        "embed_norm.cu",
        include_str!("../../../kernels/embed_norm.cu"),
    ),
    ("matvec.cu", include_str!("../../../kernels/matvec.cu")),
    ("matmul.cu", include_str!("../../../kernels/matmul.cu")),
    (
        "attention.cu",
        include_str!("../../../kernels/attention.cu"),
    ),
    ("batch.cu", include_str!("../../../kernels/batch.cu")),
    ("draw.cu", include_str!("../../../kernels/draw.cu")),
    (
        "persistent.cu",
        include_str!("../../../kernels/persistent.cu"),
    ),
];

/// One translation unit of every kernel file: the header pasted in place of its includes.
/// With `dir` (`WASI_NN_HOST_KERNELS=DIR`) the files are read from there instead of the
/// copies built into the binary (development: kernel variants without a rebuild).
pub fn kernel_source(dir: Option<&Path>) -> Result<String, CudaError> {
    let mut src = String::new();
    for (name, built_in) in KERNEL_SOURCES {
        let text = match dir {
            Some(dir) => {
                let path = dir.join(name);
                std::fs::read_to_string(&path)
                    .map_err(|source| CudaError::KernelFile { path, source })?
            }
            None => built_in.to_string(),
        };
        src.push_str(&format!("// ---- {name}\n"));
        for line in text.lines() {
            if !line.starts_with("#include \"common.cuh\"") && !line.starts_with("#pragma once") {
                src.push_str(line);
                src.push('\n');
            }
        }
    }
    Ok(src)
}

/// NVRTC's options for `arch`: the architecture, C++17, and the shared constants.
fn options(arch: &str, defines: &Defines) -> Vec<String> {
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    options.extend(
        defines
            .iter()
            .map(|(name, value)| format!("-D{name}={value}")),
    );
    options
}

/// Compile all kernels (the files of `kernels_dir`, else the built-in copies) to PTX for
/// `arch` (e.g. `compute_90`) with NVRTC; no GPU needed.
pub fn compile_kernels(
    arch: &str,
    defines: &Defines,
    kernels_dir: Option<&Path>,
) -> Result<String, CudaError> {
    compile_source(kernel_source(kernels_dir)?, arch, defines)
}

fn compile_source(source: String, arch: &str, defines: &Defines) -> Result<String, CudaError> {
    let opts = cudarc::nvrtc::CompileOptions {
        options: options(arch, defines),
        ..Default::default()
    };
    let missing = || CudaError::unavailable("NVRTC (libnvrtc) was not found; set LD_LIBRARY_PATH");
    // cudarc panics when libnvrtc cannot be loaded: look for it first (no panic message on
    // stderr), and turn a panic that still comes into the same error.
    // SAFETY: only tries to open the library by its usual names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(missing());
    }
    let compiled = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(source, opts))
        .map_err(|_| missing())?;
    Ok(compiled?.to_src())
}

/// PTX for `arch`, from `cache_dir` when the same source was compiled before with the same
/// defines (and written there otherwise).
pub(crate) fn cached_ptx(
    arch: &str,
    defines: &Defines,
    kernels_dir: Option<&Path>,
    cache_dir: Option<&Path>,
) -> Result<String, CudaError> {
    use std::hash::{Hash, Hasher};
    let source = kernel_source(kernels_dir)?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut hasher);
    options(arch, defines).hash(&mut hasher);
    let file = cache_dir.map(|d| d.join(format!("kernels-{:016x}-{arch}.ptx", hasher.finish())));
    if let Some(ptx) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        return Ok(ptx);
    }
    let ptx = compile_source(source, arch, defines)?;
    if let Some(file) = file {
        // A cache we cannot write is only slower.
        let _ = file.parent().map(std::fs::create_dir_all);
        let _ = std::fs::write(&file, &ptx);
    }
    Ok(ptx)
}
