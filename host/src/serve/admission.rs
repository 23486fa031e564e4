//! Admission: places for a request's guests under the cap on guests running at once, at
//! once or after a wait in a bounded queue (a 429 beyond it or after its timeout).

use super::error::ApiError;
use super::metrics;
use super::Service;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::OwnedSemaphorePermit;

/// Places for `guests` guests: at once, or after a wait in the bounded queue.
pub(super) async fn admit(
    service: &Arc<Service>,
    guests: usize,
) -> Result<OwnedSemaphorePermit, ApiError> {
    let guests = guests as u32;
    if let Ok(permit) = service.guests.clone().try_acquire_many_owned(guests) {
        return Ok(permit);
    }
    /// Counts a request as queued while it waits (also when its client goes away).
    struct QueuedRequest<'a>(&'a Service);
    impl Drop for QueuedRequest<'_> {
        fn drop(&mut self) {
            let left = self.0.queued.fetch_sub(1, Ordering::Relaxed) - 1;
            metrics::queued(left);
        }
    }
    let before = service.queued.fetch_add(1, Ordering::Relaxed);
    let queued = QueuedRequest(service);
    if before >= service.config.max_queue {
        drop(queued);
        return Err(ApiError::too_many(format!(
            "the service is at capacity: {} guests running and {before} requests queued; \
             retry later",
            service.max_concurrent
        )));
    }
    metrics::queued(before + 1);
    let wait = service.config.queue_timeout;
    let permit =
        tokio::time::timeout(wait, service.guests.clone().acquire_many_owned(guests)).await;
    drop(queued);
    match permit {
        Ok(Ok(permit)) => Ok(permit),
        Ok(Err(_closed)) => Err(ApiError::busy("the service is shutting down")),
        Err(_) => Err(ApiError::too_many(format!(
            "no guest became free within {wait:?}; retry later"
        ))),
    }
}
