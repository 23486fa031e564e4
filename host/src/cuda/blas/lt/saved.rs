//! The algorithms that timing chose ([`super::tune`]), kept in the cache folder between runs so
//! that a service started again on the same GPU does not time them again. cuBLASLt documents
//! its algorithm descriptions as plain data, valid with the same library version, so a file
//! holds one GPU model's (its name and SM count) with one cuBLASLt version, and each restored
//! algorithm must still pass cuBLASLt's check for its shape.

use super::{Lt, Plan, Shape};
use cudarc::cublaslt::sys;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// What a file holds: the GPU and library it was timed on, then each plain product's shape
/// and algorithm.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct SavedAlgorithms {
    gpu: String,
    sms: usize,
    cublaslt: usize,
    products: Vec<SavedProduct>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct SavedProduct {
    rows: usize,
    n: usize,
    k: usize,
    ldc: usize,
    /// None: cuBLAS's default was the fastest.
    algo: Option<[u64; 8]>,
}

/// The cuBLASLt version loaded (0 where it cannot be asked).
fn cublaslt_version() -> usize {
    // SAFETY: no arguments; cudarc panics where the library or the symbol is missing.
    std::panic::catch_unwind(|| unsafe { sys::cublasLtGetVersion() }).unwrap_or(0)
}

/// The file name of a GPU's tuned algorithms under the running cuBLASLt.
pub(crate) fn file_name(gpu: &str, sms: usize) -> String {
    name_for(gpu, sms, cublaslt_version())
}

fn name_for(gpu: &str, sms: usize, cublaslt: usize) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (gpu, sms, cublaslt).hash(&mut hasher);
    format!("cublaslt-tuned-{:016x}.json", hasher.finish())
}

/// The products a file holds for this GPU and library (none where it is missing, unreadable,
/// or from another GPU or version).
fn read(path: &Path, gpu: &str, sms: usize, cublaslt: usize) -> Vec<SavedProduct> {
    let Ok(bytes) = std::fs::read(path) else {
        return Vec::new();
    };
    match serde_json::from_slice::<SavedAlgorithms>(&bytes) {
        Ok(saved) if saved.gpu == gpu && saved.sms == sms && saved.cublaslt == cublaslt => {
            saved.products
        }
        _ => Vec::new(),
    }
}

impl Lt {
    /// Install the algorithms saved at `path` for this GPU as the plans of their shapes, each
    /// where cuBLASLt's check accepts it, and the shapes saved as cuBLAS's default's; the
    /// shapes installed.
    pub(crate) fn restore_tuned(&self, path: &Path, gpu: &str, sms: usize) -> Vec<Shape> {
        let products = read(path, gpu, sms, cublaslt_version());
        let mut restored = Vec::with_capacity(products.len());
        for p in products {
            let shape = Shape::plain((p.rows, p.n, p.k), p.ldc, false);
            let plan = match p.algo {
                Some(data) => {
                    let algo = sys::cublasLtMatmulAlgo_t { data };
                    let Some(mut plan) = Plan::describe(shape) else {
                        continue;
                    };
                    if !plan.accepts(self.handle, &algo, self.workspace.1) {
                        continue;
                    }
                    plan.algo = algo;
                    Some(plan)
                }
                None => None,
            };
            let Ok(mut cache) = self.plans.lock() else {
                break;
            };
            cache.tuned.insert(shape, plan.as_ref().map(|p| p.algo));
            if let Some(plan) = plan {
                cache.plans.insert(shape, Some(plan));
            }
            restored.push(shape);
        }
        restored
    }

    /// Write every tuned plain product's algorithm to `path` (a file we cannot write is
    /// only a slower next start: the error is for the caller to log).
    pub(crate) fn save_tuned(&self, path: &Path, gpu: &str, sms: usize) -> std::io::Result<()> {
        let products = match self.plans.lock() {
            Ok(cache) => (cache.tuned.iter())
                .map(|(s, algo)| SavedProduct {
                    rows: s.rows,
                    n: s.n,
                    k: s.k,
                    ldc: s.ldc,
                    algo: algo.map(|a| a.data),
                })
                .collect(),
            Err(_) => return Ok(()),
        };
        write(path, gpu, sms, cublaslt_version(), products)
    }
}

fn write(
    path: &Path,
    gpu: &str,
    sms: usize,
    cublaslt: usize,
    mut products: Vec<SavedProduct>,
) -> std::io::Result<()> {
    products.sort_by_key(|p| (p.n, p.k, p.rows, p.ldc));
    let saved = SavedAlgorithms {
        gpu: gpu.to_owned(),
        sms,
        cublaslt,
        products,
    };
    let bytes = serde_json::to_vec(&saved).map_err(std::io::Error::other)?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // written whole under a name of its own, then renamed: a reader never sees half a file,
    // and two saves at once (two GPUs of one model) do not write into one another's
    static SAVES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let save = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let partial = path.with_extension(format!("partial-{}-{save}", std::process::id()));
    std::fs::write(&partial, bytes)?;
    std::fs::rename(&partial, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn product(rows: usize) -> SavedProduct {
        SavedProduct {
            rows,
            n: 4800,
            k: 1600,
            ldc: 4800,
            algo: (rows != 64).then_some([rows as u64, 1, 2, 3, 4, 5, 6, u64::MAX]),
        }
    }

    #[test]
    fn a_file_is_read_back_for_its_own_gpu_and_library_only() -> std::io::Result<()> {
        let dir = std::env::temp_dir().join(format!("lt-saved-{}", std::process::id()));
        let path = dir.join(name_for("NVIDIA H200", 132, 130_000));
        write(
            &path,
            "NVIDIA H200",
            132,
            130_000,
            vec![product(96), product(64)],
        )?;
        let back = read(&path, "NVIDIA H200", 132, 130_000);
        assert_eq!(back, vec![product(64), product(96)]);
        assert!(read(&path, "NVIDIA H100 80GB HBM3", 132, 130_000).is_empty());
        assert!(read(&path, "NVIDIA H200", 114, 130_000).is_empty());
        assert!(read(&path, "NVIDIA H200", 132, 120_000).is_empty());
        std::fs::write(&path, b"{not json")?;
        assert!(read(&path, "NVIDIA H200", 132, 130_000).is_empty());
        assert!(read(&dir.join("missing.json"), "NVIDIA H200", 132, 130_000).is_empty());
        std::fs::remove_dir_all(&dir)
    }

    #[test]
    fn file_names_differ_by_gpu_sms_and_library() {
        let base = name_for("NVIDIA H200", 132, 130_000);
        assert!(base.starts_with("cublaslt-tuned-") && base.ends_with(".json"));
        assert_ne!(base, name_for("NVIDIA H100", 132, 130_000));
        assert_ne!(base, name_for("NVIDIA H200", 114, 130_000));
        assert_ne!(base, name_for("NVIDIA H200", 132, 130_100));
        assert_eq!(base, name_for("NVIDIA H200", 132, 130_000));
    }
}
