//! The kernels' source and its compilation: every `.cu` file of `kernels/` (built into the
//! binary) pasted into one translation unit, compiled with NVRTC for the GPU at hand with the
//! constants both sides share handed over as `-D` defines (the caller's), and the result cached
//! on disk by a hash of source, defines and architecture. The GPU loads machine code for its
//! own architecture (CUBIN), made once, or found prebuilt (a container image's), so that a
//! start skips both NVRTC and the driver's compile of PTX (on an H200, 8 and 7.5 s of an 18 s
//! first start); PTX remains where NVRTC cannot make a CUBIN.

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

/// NVRTC's image of `source` for `arch`: machine code for `sm_XY`, PTX for `compute_XY`.
fn compile_source(source: String, arch: &str, defines: &Defines) -> Result<KernelImage, CudaError> {
    match is_machine_code(arch) {
        true => compile_cubin(source, arch, defines).map(KernelImage::Cubin),
        false => compile_ptx(source, arch, defines).map(KernelImage::Ptx),
    }
}

fn compile_ptx(source: String, arch: &str, defines: &Defines) -> Result<String, CudaError> {
    let opts = cudarc::nvrtc::CompileOptions {
        options: options(arch, defines),
        ..Default::default()
    };
    // cudarc panics when libnvrtc cannot be loaded: look for it first (no panic message on
    // stderr), and turn a panic that still comes into the same error.
    require_nvrtc()?;
    let compiled = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(source, opts))
        .map_err(|_| no_nvrtc())?;
    Ok(compiled?.to_src())
}

/// A compiled form of the kernels that the driver loads.
pub enum KernelImage {
    /// Machine code for one architecture (`sm_90`), loaded as it is.
    Cubin(Vec<u8>),
    /// PTX (`compute_90`), which the driver compiles at load.
    Ptx(String),
}

impl KernelImage {
    /// Its bytes, as written to a file.
    pub fn bytes(&self) -> &[u8] {
        match self {
            KernelImage::Cubin(bytes) => bytes,
            KernelImage::Ptx(text) => text.as_bytes(),
        }
    }
}

/// The kernels compiled for `arch` (machine code for `sm_XY`, PTX for `compute_XY`), and the
/// name it has in a cache or a prebuilt folder.
pub fn compile_image(
    arch: &str,
    defines: &Defines,
    kernels_dir: Option<&Path>,
) -> Result<(KernelImage, String), CudaError> {
    let source = kernel_source(kernels_dir)?;
    let name = image_file_name(&source, arch, defines);
    Ok((compile_source(source, arch, defines)?, name))
}

/// The name a compiled image of `source` for `arch` has in a cache or a prebuilt folder: a
/// hash of the source and NVRTC's options (the defines and the architecture).
fn image_file_name(source: &str, arch: &str, defines: &Defines) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut hasher);
    options(arch, defines).hash(&mut hasher);
    let kind = if is_machine_code(arch) {
        "cubin"
    } else {
        "ptx"
    };
    format!("kernels-{:016x}-{arch}.{kind}", hasher.finish())
}

fn is_machine_code(arch: &str) -> bool {
    arch.starts_with("sm_")
}

/// The kernels for a GPU of compute capability `cc` (`"90"`): machine code (`sm_XY`) where
/// `cubin`, else or where NVRTC cannot make it (an NVRTC older than the GPU) PTX
/// (`compute_XY`), which the driver compiles at load. Each from `prebuilt` or `cache_dir`
/// where the same source was compiled before with the same defines, else compiled and
/// written to `cache_dir`.
pub(crate) fn cached_image(
    cc: &str,
    cubin: bool,
    defines: &Defines,
    kernels_dir: Option<&Path>,
    dirs: (Option<&Path>, Option<&Path>),
) -> Result<KernelImage, CudaError> {
    let ptx = format!("compute_{cc}");
    if cubin {
        let sm = format!("sm_{cc}");
        match cached_arch(&sm, defines, kernels_dir, dirs) {
            Ok(image) => return Ok(image),
            Err(e) => tracing::warn!("no CUBIN for {sm} ({e}); the driver compiles PTX instead"),
        }
    }
    cached_arch(&ptx, defines, kernels_dir, dirs)
}

/// The kernels for `arch`, found in `prebuilt` or `cache_dir`, else compiled (and written to
/// `cache_dir`).
fn cached_arch(
    arch: &str,
    defines: &Defines,
    kernels_dir: Option<&Path>,
    (prebuilt, cache_dir): (Option<&Path>, Option<&Path>),
) -> Result<KernelImage, CudaError> {
    let source = kernel_source(kernels_dir)?;
    let name = image_file_name(&source, arch, defines);
    let read = |dir: &Path| {
        let bytes = std::fs::read(dir.join(&name)).ok()?;
        match is_machine_code(arch) {
            true => Some(KernelImage::Cubin(bytes)),
            false => String::from_utf8(bytes).ok().map(KernelImage::Ptx),
        }
    };
    if let Some(image) = [prebuilt, cache_dir].into_iter().flatten().find_map(read) {
        return Ok(image);
    }
    let image = compile_source(source, arch, defines)?;
    if let Some(dir) = cache_dir {
        // A cache we cannot write is only slower.
        let _ = std::fs::create_dir_all(dir);
        let _ = std::fs::write(dir.join(&name), image.bytes());
    }
    Ok(image)
}

/// NVRTC's CUBIN of `source` for `arch` (`sm_XY`).
fn compile_cubin(source: String, arch: &str, defines: &Defines) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, CompileError};
    require_nvrtc()?;
    let source = std::ffi::CString::new(source)
        .map_err(|_| CudaError::unavailable("the kernels' source holds a NUL byte"))?;
    let options = options(arch, defines);
    // cudarc panics where a symbol of libnvrtc is missing: the same error as no library
    std::panic::catch_unwind(move || {
        let prog = result::create_program(&source, None).map_err(CompileError::CreationError)?;
        // SAFETY: `prog` was just created and is destroyed once, below, whatever happens.
        let built = unsafe { cubin_of(prog, &options) };
        // SAFETY: as above.
        let destroyed = unsafe { result::destroy_program(prog) };
        let cubin = built?;
        destroyed.map_err(CompileError::DestroyError)?;
        Ok(cubin)
    })
    .map_err(|_| no_nvrtc())?
}

fn no_nvrtc() -> CudaError {
    CudaError::unavailable("NVRTC (libnvrtc) was not found; set LD_LIBRARY_PATH")
}

/// Whether libnvrtc can be opened (cudarc panics at its first call where it cannot).
fn require_nvrtc() -> Result<(), CudaError> {
    // SAFETY: only tries to open the library by its usual names.
    match unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        true => Ok(()),
        false => Err(no_nvrtc()),
    }
}

/// Compiles `prog` with `options` and reads its CUBIN back.
///
/// # Safety
/// `prog` must be a live NVRTC program.
unsafe fn cubin_of(
    prog: cudarc::nvrtc::sys::nvrtcProgram,
    options: &[String],
) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, sys, CompileError};
    // SAFETY: the caller's.
    if let Err(nvrtc) = unsafe { result::compile_program(prog, options) } {
        // SAFETY: the caller's; the log is a NUL-terminated string.
        let log = unsafe { result::get_program_log(prog) }.map_err(CompileError::GetLogError)?;
        let log = unsafe { std::ffi::CStr::from_ptr(log.as_ptr()) }.to_owned();
        return Err(CompileError::CompileError {
            nvrtc,
            options: options.to_vec(),
            log,
        }
        .into());
    }
    let mut size = 0usize;
    // SAFETY: the caller's; `size` outlives the call.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(CompileError::GetPtxError)?;
    let mut cubin = vec![0u8; size];
    // SAFETY: the caller's; `cubin` holds the `size` bytes NVRTC writes.
    unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(CompileError::GetPtxError)?;
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFINES: &Defines = &[("ONE", 1)];

    #[test]
    fn an_image_is_named_by_its_source_options_and_kind() {
        let name =
            |source: &str, arch: &str, defines: &Defines| image_file_name(source, arch, defines);
        let cubin = name("a", "sm_90", DEFINES);
        assert!(cubin.starts_with("kernels-") && cubin.ends_with("-sm_90.cubin"));
        assert!(name("a", "compute_90", DEFINES).ends_with("-compute_90.ptx"));
        assert_eq!(
            cubin,
            name("a", "sm_90", DEFINES),
            "the same inputs, the same name"
        );
        for other in [
            name("b", "sm_90", DEFINES),
            name("a", "sm_80", DEFINES),
            name("a", "sm_90", &[("ONE", 2)]),
        ] {
            assert_ne!(cubin, other);
        }
    }

    /// A prebuilt CUBIN is taken before the cache's and neither is compiled: no NVRTC needed.
    #[test]
    fn a_prebuilt_cubin_comes_before_the_cache_and_the_compiler() {
        let root = std::env::temp_dir().join(format!("wasi-nn-prebuilt-{}", std::process::id()));
        let (prebuilt, cache) = (root.join("prebuilt"), root.join("cache"));
        let name = image_file_name(&kernel_source(None).expect("built in"), "sm_90", DEFINES);
        for (dir, bytes) in [(&prebuilt, b"prebuilt"), (&cache, b"cached!!")] {
            std::fs::create_dir_all(dir).expect("a temporary folder");
            std::fs::write(dir.join(&name), bytes).expect("a file");
        }
        let image = |dirs| match cached_image("90", true, DEFINES, None, dirs) {
            Ok(KernelImage::Cubin(bytes)) => bytes,
            _ => panic!("a CUBIN from the folders"),
        };
        assert_eq!(image((Some(&prebuilt), Some(&cache))), b"prebuilt");
        assert_eq!(image((None, Some(&cache))), b"cached!!");
        let _ = std::fs::remove_dir_all(&root);
    }
}
