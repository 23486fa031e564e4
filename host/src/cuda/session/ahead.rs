//! A decode step run ahead on the session's own stream, before its guest asks for it.
//!
//! After a greedy guest's decode through this session's graph, the next step can start at
//! once: its token is the argmax of the step just run, fed on the GPU, and its logits go to
//! a buffer the guest is not reading ([`CudaSession::launch_ahead_decode`]). When the guest
//! comes back with exactly that token at that position, the step is taken as done
//! ([`CudaSession::take_ahead_decode`]); anything else runs after it and overwrites what it
//! wrote. Before a batched pass (on another stream) touches the session, the session's own
//! stream is waited for ([`CudaSession::settle_own`]).

use super::CudaSession;
use crate::cuda::buffer::HostCopy;
use crate::cuda::error::DriverContext;
use crate::cuda::ops::matvec::argmax_row;
use crate::engine::EngineError;

impl CudaSession {
    /// Launch this session's next decode step now, on its own stream, ahead of its guest:
    /// its token is the argmax of the step just run (fed on the GPU), its logits go to the
    /// buffer the guest is not reading, so nothing the guest can still read changes. When
    /// the guest comes back with exactly that token at that position, its step is done or
    /// under way ([`Self::take_ahead_decode`]); any other call runs after it and overwrites
    /// what it wrote. Returns the argmax of the step just run (read back through page-locked
    /// memory), or None when no step can run ahead: no room, no captured graphs, or the last
    /// step was not a decode through this session's graph (`ids[0]` holds another position).
    pub(crate) fn launch_ahead_decode(&mut self) -> Result<Option<u32>, EngineError> {
        let last_decode = self.read_out.follows_own_decode();
        let graphs = self.model.gpu.measurement().graphs
            && !self.capture_failed
            && self.decode_graph.is_some();
        if !last_decode || !graphs || self.read_out.len() >= self.capacity {
            return Ok(None);
        }
        // the step run ahead writes a buffer not being read (the first or the second)
        let which = self.read_out.own_ahead_buffer();
        if self.ahead_decode_graphs[which].is_none() {
            let logits = self.logits_buffer(which).ptr();
            match self.capture(|s| s.decode_kernels_into(true, logits)) {
                Ok(Some(graph)) => self.ahead_decode_graphs[which] = Some(graph),
                Ok(None) => return Ok(None),
                Err(e) => {
                    tracing::warn!("capturing a decode run ahead failed, not running ahead: {e}");
                    self.capture_failed = true;
                    return Ok(None);
                }
            }
        }
        let stream = self.launcher.stream().clone();
        if self.argmax_key_host.is_none() {
            self.argmax_key_host = Some(HostCopy::new(&stream, 1)?);
        }
        let (Some(copy), Some(graph)) = (
            self.argmax_key_host.as_mut(),
            self.ahead_decode_graphs[which].as_ref(),
        ) else {
            return Ok(None);
        };
        // this step's argmax key goes out before the step run ahead clears it
        copy.start(&stream, &self.argmax_key, 1)?;
        graph.launch().ctx("decode run ahead")?;
        self.read_out.own_ahead_launched();
        let key = copy.wait()?.first().copied().unwrap_or(0);
        let argmax = argmax_row(key);
        // the kernel feeds row 0 for a row past the vocabulary (never an argmax): no guess then
        self.read_out
            .own_ahead_fed(argmax, which, self.model.config.vocab_size);
        Ok(Some(argmax))
    }

    /// Take the decode run ahead as this session's next step when it is `token` at the
    /// current position: the position advances and its logits buffer becomes the one read
    /// (the step may still be under way; reads are ordered after it on the stream). False, and
    /// the step run ahead forgotten, otherwise.
    pub(crate) fn take_ahead_decode(&mut self, token: u32) -> bool {
        let taken = self.read_out.take_own_ahead(token);
        if taken {
            // its key is the argmax
            self.set_keys_drawn(None);
        }
        taken
    }

    /// Forget any decode run ahead and wait for this session's own stream if work run ahead
    /// may still be under way on it: before a batched pass (on another stream) reads or writes
    /// the session's cache and logits.
    pub(crate) fn settle_own(&mut self) -> Result<(), EngineError> {
        self.read_out.forget_own_ahead();
        if self.read_out.own_in_flight() {
            self.synchronize()?;
            self.read_out.own_settled();
        }
        Ok(())
    }

    /// Nothing run ahead on the session's own stream (see [`Self::settle_own`]).
    pub(crate) fn idle_own(&self) -> bool {
        self.read_out.idle_own()
    }
}
