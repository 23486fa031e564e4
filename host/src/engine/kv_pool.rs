//! The KV pool: one cap on the KV-cache bytes of every context of a model together.

use super::EngineError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A cap on the KV-cache bytes of every context of one model together. A context reserves
/// what its cache grows by before a step and gives it back when it shrinks or is dropped;
/// a reservation past the cap fails that context alone.
pub struct KvPool {
    cap: usize,
    used: AtomicUsize,
}

impl KvPool {
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self {
            cap,
            used: AtomicUsize::new(0),
        })
    }

    /// Bytes reserved now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Reserve `bytes`, or say how far over the cap that would go.
    pub fn reserve(&self, bytes: usize) -> Result<(), EngineError> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let wanted = used.saturating_add(bytes);
            if wanted > self.cap {
                return Err(EngineError::KvPoolFull {
                    needed: bytes,
                    used,
                    cap: self.cap,
                });
            }
            match self
                .used
                .compare_exchange_weak(used, wanted, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(now) => used = now,
            }
        }
    }

    pub fn release(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}
