//! Timing a product as a pass runs it: its weights not in L2. Each run is preceded by a write
//! over twice the GPU's L2 cache, and timed alone between its own events; repeating a product
//! back to back would time it with its weights cached, which for the batched pass's few
//! megabytes a layer ranks the algorithms differently from the pass.

use crate::cuda::buffer::DevBuf;
use crate::cuda::error::{CudaError, DriverContext};
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::Arc;

pub struct ColdTimer {
    stream: Arc<CudaStream>,
    /// Written before each run: its bytes push the last run's data out of L2.
    flush: DevBuf<u8>,
    /// An event pair a timed run.
    events: Vec<(CudaEvent, CudaEvent)>,
}

impl ColdTimer {
    /// A timer of `reps` runs (at least one) on `stream`, with its L2 flush buffer.
    pub fn new(stream: &Arc<CudaStream>, reps: usize) -> Result<Self, CudaError> {
        let l2 = (stream.context())
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .ctx("L2 size")?;
        let bytes = 2 * usize::try_from(l2).unwrap_or(0).max(1 << 20);
        let event = || {
            (stream.context())
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .ctx("timing a product")
        };
        let events = (0..reps.max(1))
            .map(|_| Ok((event()?, event()?)))
            .collect::<Result<_, CudaError>>()?;
        Ok(Self {
            stream: stream.clone(),
            flush: DevBuf::zeros(stream, bytes, "L2 flush buffer")?,
            events,
        })
    }

    /// The mean time of the timer's runs of `run` (each enqueueing one product on its
    /// stream), each after L2 was flushed, in microseconds. Synchronizes the stream.
    pub fn time(
        &mut self,
        mut run: impl FnMut() -> Result<(), CudaError>,
    ) -> Result<f32, CudaError> {
        let Self {
            stream,
            flush,
            events,
        } = self;
        for (begin, end) in events.iter() {
            flush.clear(stream)?;
            begin.record(stream).ctx("timing a product")?;
            run()?;
            end.record(stream).ctx("timing a product")?;
        }
        stream.synchronize().ctx("timing a product")?;
        let mut total_ms = 0.0;
        for (begin, end) in events.iter() {
            total_ms += begin.elapsed_ms(end).ctx("timing a product")?;
        }
        Ok(total_ms * 1e3 / events.len() as f32)
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}
