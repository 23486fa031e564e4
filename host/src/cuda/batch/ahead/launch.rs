//! Putting the run-ahead plan on the GPU: the pass run ahead (the steps planned and the step's
//! late rows, launched without waiting for them), and a lone decode's next step on its
//! session's own stream.

use super::state::{Ahead, AheadRow, InFlight, LateRow, NextStep, RowTargets};
use crate::cuda::batch::contexts::CudaSeq;
use crate::cuda::batch::pass::Rows;
use crate::cuda::batch::CudaBatch;
use crate::cuda::buffer::HostCopy;
use crate::engine::batch::StepItem;
use crate::engine::{EngineError, Session};
use std::sync::atomic::Ordering;
use std::time::Instant;

impl CudaBatch {
    /// A lone decode whose step was run ahead on its session's own stream, with the token
    /// guessed: take that step, and run the next one ahead for a greedy guest (its argmax comes
    /// back once the step taken ends). False for any other step (a step run ahead for it is
    /// forgotten: the step waits for it before anything else uses the session).
    pub(crate) fn take_lone_decode_ahead(&self, item: &mut StepItem<'_, CudaSeq>) -> bool {
        let [token] = *item.tokens else {
            return false;
        };
        if item.all_positions || item.error.is_some() {
            return false;
        }
        if !item
            .seq
            .session_mut()
            .is_ok_and(|s| s.take_ahead_decode(token))
        {
            return false;
        }
        // a lone decode's own next step feeds its argmax: not for a guest that reads logits
        // or draws its tokens
        let sampled = item.seq.read_logits.swap(false, Ordering::Relaxed) || item.seq.draws();
        let ran = item.seq.session_mut().and_then(|s| {
            match sampled || !self.exec.gpu.measurement().run_ahead {
                true => Ok(None),
                false => s.launch_ahead_decode(),
            }
        });
        if let Err(e) = ran {
            item.error = Some(e);
        }
        true
    }

    /// Launch the pass run ahead (see [`super`]): the steps `picks` (contexts' next
    /// steps run ahead, see [`super::plan::plan_ahead`], and those of contexts whose late rows were
    /// resolved) and the rows of `items[late]`, which this step does not wait for
    /// (`greedy[i]`: a step may be run ahead after them). Returns the pass for the caller to
    /// keep; on an error nothing was launched.
    pub(crate) fn launch_ahead(
        &self,
        ahead: &mut Ahead,
        items: &mut [StepItem<'_, CudaSeq>],
        picks: Vec<(u64, NextStep)>,
        late: &[usize],
        greedy: &[bool],
    ) -> Result<InFlight, EngineError> {
        let begun = Instant::now();
        // each row's draw, made once for its rows and its record (edits after a token are a copy)
        let drawn: Vec<_> = picks.iter().map(|(_, next)| next.drawn()).collect();
        let mut inputs: Vec<Rows<'_>> = (picks.iter().zip(&drawn))
            .map(|((_, next), drawn)| next.rows(drawn.clone()))
            .collect();
        for &i in late {
            inputs.push(self.rows_of(&items[i])?);
        }
        let launched = Instant::now();
        let timing = ahead.clock.events(self.pass.stream());
        let reusable = ahead.reusable_keys.pop();
        let (n, last_rows, keys) = self.pass.with_buffers(|b| {
            let stream = b.stream().clone();
            let mut keys = match reusable {
                Some(keys) => keys,
                None => HostCopy::new(&stream, self.pass.max_rows())?,
            };
            // timing is best-effort: an event that failed to record reads as no time
            if let Some((begin, _)) = &timing {
                let _ = begin.record(&stream);
            }
            let (n, last_rows) = self.pass.launch_rows(b, &inputs)?;
            // the keys come back behind the pass, while the next pass may already run
            keys.start(&stream, &b.keys, n)?;
            if let Some((_, end)) = &timing {
                let _ = end.record(&stream);
            }
            Ok((n, last_rows, keys))
        })?;
        drop(inputs);
        tracing::trace!(
            picks_us = (launched - begun).as_micros() as u64,
            buffers_us = launched.elapsed().as_micros() as u64,
            "pass run ahead launched"
        );
        let mut last = last_rows.into_iter();
        let rows: Vec<AheadRow> = (picks.iter().zip(drawn))
            .zip(last.by_ref())
            .map(|(((serial, next), drawn), row)| AheadRow {
                serial: *serial,
                position: next.position,
                token: next.token,
                fed: next.fed.is_some(),
                row,
                buffer: next.buffer,
                rule: drawn,
            })
            .collect();
        let mut late_rows = Vec::with_capacity(late.len());
        for (&i, row) in late.iter().zip(last) {
            let item = &mut items[i];
            let added = item.tokens.len();
            let seq = &mut *item.seq;
            let serial = seq.serial;
            let rule = seq.drawn_by(item.last_chunk);
            let Ok(session) = seq.session_mut() else {
                continue;
            };
            session.advanced_late(added);
            // its key is drawn as its rows in the pass are (`rows_of`)
            session.set_keys_drawn(rule.clone());
            let room = session.len() < session.capacity();
            // the token is the argmax, known when the pass is resolved; the late row writes
            // the first buffer, which its guest reads next
            let next = (greedy[i] && room).then(|| NextStep {
                token: 0,
                fed: None,
                position: session.len(),
                targets: RowTargets::of(session),
                buffer: 1,
                rule,
            });
            seq.late.store(true, Ordering::Release);
            item.deferred = true;
            late_rows.push(LateRow { serial, row, next });
        }
        ahead.counts.late += late_rows.len() as u64;
        ahead.counts.flights += 1;
        Ok(InFlight {
            id: ahead.counts.flights,
            rows,
            late: late_rows,
            n,
            launched,
            keys,
            timing,
        })
    }

    /// How many steps may be run ahead of a guest (`WASI_NN_HOST_AHEAD_DEPTH`).
    pub(crate) fn depth(&self) -> usize {
        self.exec.gpu.settings().ahead_depth
    }
}
