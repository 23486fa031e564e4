//! Continuous batching across execution contexts on the CPU: contexts that step at the same
//! time share batched steps, and each gets what it would get alone.

use integration_tests::*;
use std::sync::{Arc, Barrier};
use wasi_nn_host::cpu::batched::CpuBatch;
use wasi_nn_host::cpu::{CpuExecutor, CpuKvCache, CpuModel};
use wasi_nn_host::engine::batch::{BatchModel, KvPool, SeqState, StepItem};
use wasi_nn_host::engine::{EngineError, Executor};
use wasi_nn_host::model::{self, Gpt2Weights};
use wasi_nn_host::runtime::{HostBuilder, RunOptions};
use wasi_nn_host::Device;

fn shakespeare() -> Arc<Gpt2Weights> {
    Arc::new(model::load_path(&shakespeare_dir()).expect("load"))
}

/// Distinct prompts of different lengths, spread over the vocabulary.
fn prompt(i: usize, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|t| (t * 7919 + i as u32 * 104_729 + 11) % 50257)
        .collect()
}

#[test]
fn a_batched_step_equals_each_context_alone() {
    let weights = shakespeare();
    let batch = CpuBatch::new(weights.clone(), KvPool::new(usize::MAX));
    let spec = CpuModel::new(weights.clone());
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(i, 3 + 7 * i)).collect();
    let mut seqs: Vec<_> = prompts
        .iter()
        .map(|_| batch.new_seq().expect("seq"))
        .collect();
    let mut caches: Vec<CpuKvCache> = prompts.iter().map(|_| CpuKvCache::default()).collect();
    // step 1: every prompt at once, the third asking for every position's logits
    let mut items: Vec<StepItem<'_, _>> = seqs
        .iter_mut()
        .zip(&prompts)
        .enumerate()
        .map(|(i, (seq, p))| StepItem {
            seq,
            tokens: p,
            all_positions: i == 2,
            first_chunk: true,
            last_chunk: true,
            request_tokens: p.len(),
            error: None,
            deferred: false,
        })
        .collect();
    batch.step(&mut items);
    assert!(items.iter().all(|i| i.error.is_none()));
    drop(items);
    let mut worst = 0.0f32;
    for (i, (seq, p)) in seqs.iter().zip(&prompts).enumerate() {
        let want = spec.forward(&mut caches[i], p, i == 2);
        let got = if i == 2 {
            seq.all_logits().expect("logits")
        } else {
            seq.last_logits().expect("logits")
        };
        worst = worst.max(assert_close(&got, &want, 1e-4, &format!("prompt {i}")));
        assert_eq!(seq.len(), p.len());
    }
    // steps 2..9: one decode token each, plus a new prompt joining mid-way
    for step in 0..8 {
        let next: Vec<u32> = seqs.iter().map(|s| s.argmax().expect("argmax")).collect();
        let mut items: Vec<StepItem<'_, _>> = seqs
            .iter_mut()
            .zip(&next)
            .map(|(seq, t)| StepItem {
                seq,
                tokens: std::slice::from_ref(t),
                all_positions: false,
                first_chunk: true,
                last_chunk: true,
                request_tokens: 1,
                error: None,
                deferred: false,
            })
            .collect();
        batch.step(&mut items);
        drop(items);
        for (i, (seq, &t)) in seqs.iter().zip(&next).enumerate() {
            let want = spec.forward(&mut caches[i], &[t], false);
            let what = format!("decode step {step} of context {i}");
            worst = worst.max(assert_close(
                &seq.last_logits().expect("logits"),
                &want,
                1e-4,
                &what,
            ));
        }
    }
    eprintln!("worst scaled error batched vs the specification: {worst:e}");
}

#[test]
fn concurrent_streams_share_steps_and_equal_their_single_stream_ids() {
    let weights = shakespeare();
    let executor = Arc::new(CpuExecutor::new(weights.clone(), 1 << 30));
    let streams = 6;
    let steps = 24;
    let prompts: Vec<Vec<u32>> = (0..streams).map(|i| prompt(i, 5 + 3 * i)).collect();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| cpu_greedy(&weights, p, steps))
        .collect();
    let barrier = Arc::new(Barrier::new(streams));
    let handles: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|p| {
            let (executor, barrier) = (executor.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut session = executor.new_session().expect("session");
                barrier.wait();
                let mut ids = Vec::new();
                session.extend(&p, false).expect("prompt");
                for _ in 0..steps {
                    let next = session.argmax().expect("argmax");
                    ids.push(next);
                    session.extend(&[next], false).expect("step");
                }
                ids
            })
        })
        .collect();
    for (i, handle) in handles.into_iter().enumerate() {
        assert_eq!(handle.join().expect("stream"), alone[i], "stream {i}");
    }
    let (steps_run, items, largest) = executor.batch_stats().expect("batched");
    eprintln!("{steps_run} steps, {items} items, largest step {largest}");
    assert!(largest > 1, "no step held two contexts");
    assert!(steps_run < items, "contexts shared steps");
}

#[test]
fn a_long_prompt_is_chunked_and_equals_one_prefill() {
    let weights = shakespeare();
    let executor = CpuExecutor::new(weights.clone(), 1 << 30);
    let long = prompt(9, 2 * CpuExecutor::MAX_STEP_TOKENS + 37);
    let mut session = executor.new_session().expect("session");
    session.extend(&long, true).expect("long prompt");
    let all = session.all_logits().expect("all");
    let mut cache = CpuKvCache::default();
    let want = CpuModel::new(weights).forward(&mut cache, &long, true);
    assert_close(&all, &want, 1e-4, "chunked all-position logits");
    let (steps, _, _) = executor.batch_stats().expect("batched");
    assert_eq!(steps, 3, "three chunks");
}

#[test]
fn a_failing_or_vanishing_context_leaves_the_others_unchanged() {
    let weights = shakespeare();
    let executor = Arc::new(CpuExecutor::new(weights.clone(), 1 << 30));
    let p = prompt(3, 9);
    let want = cpu_greedy(&weights, &p, 16);
    let barrier = Arc::new(Barrier::new(3));
    let good = {
        let (executor, barrier, p) = (executor.clone(), barrier.clone(), p.clone());
        std::thread::spawn(move || {
            let mut session = executor.new_session().expect("session");
            barrier.wait();
            session.extend(&p, false).expect("prompt");
            let mut ids = Vec::new();
            for _ in 0..16 {
                let next = session.argmax().expect("argmax");
                ids.push(next);
                session.extend(&[next], false).expect("step");
            }
            ids
        })
    };
    // one context sends ids outside the vocabulary and past the context, in turn
    let bad = {
        let (executor, barrier) = (executor.clone(), barrier.clone());
        std::thread::spawn(move || {
            let mut session = executor.new_session().expect("session");
            barrier.wait();
            let mut errors = 0;
            for _ in 0..8 {
                errors += usize::from(session.extend(&[50_000, 70_000], false).is_err());
                errors += usize::from(session.extend(&vec![1; 600], false).is_err());
            }
            errors
        })
    };
    // another prefills and is dropped between steps, several times
    let dropped = {
        let (executor, barrier) = (executor.clone(), barrier.clone());
        std::thread::spawn(move || {
            barrier.wait();
            for i in 0..6 {
                let mut session = executor.new_session().expect("session");
                session.extend(&prompt(20 + i, 40), false).expect("prefill");
                drop(session);
            }
        })
    };
    assert_eq!(bad.join().expect("bad"), 16, "every bad request failed");
    dropped.join().expect("dropped");
    assert_eq!(good.join().expect("good"), want);
    let (used, _) = executor.kv_pool().expect("pool");
    assert_eq!(used, 0, "every dropped context gave its KV bytes back");
}

#[test]
fn a_full_kv_pool_refuses_that_context_alone() {
    let weights = shakespeare();
    let cfg = weights.config;
    let position = 2 * cfg.n_layer * cfg.n_embd * 4;
    // room for 100 positions in all
    let executor = CpuExecutor::new(weights.clone(), 100 * position);
    let mut small = executor.new_session().expect("session");
    small
        .extend(&prompt(1, 30), false)
        .expect("30 positions fit");
    let mut big = executor.new_session().expect("session");
    let err = big
        .extend(&prompt(2, 80), false)
        .expect_err("80 more do not");
    assert!(matches!(err, EngineError::KvPoolFull { .. }), "{err}");
    assert!(err.to_string().contains("KV cache pool is full"), "{err}");
    // the first context goes on; the refused one can still take what fits
    let next = small.argmax().expect("argmax");
    small.extend(&[next], false).expect("a step still fits");
    big.extend(&prompt(2, 60), false).expect("60 fit");
    drop(small);
    big.truncate(0);
    big.extend(&prompt(2, 90), false)
        .expect("after the other context is gone, 90 fit");
}

#[test]
fn concurrent_guests_get_their_single_stream_texts() {
    let host = Arc::new(
        HostBuilder::new(Device::Cpu)
            .graph("gpt2", &shakespeare_dir())
            .expect("model")
            .build()
            .expect("host"),
    );
    let module = host.load_module(&gpt2_wasm()).expect("module");
    let run = |host: &wasi_nn_host::Host, prompt: &str| {
        let options = RunOptions {
            args: ["--json", "--max-tokens", "24", prompt]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            capture: Some(1 << 20),
            ..Default::default()
        };
        let out = host.run(&module, "gpt2.wasm", &options).expect("run");
        assert_eq!(out.exit_code, 0, "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = stdout.lines().last().unwrap_or_default().to_owned();
        let value: serde_json::Value = serde_json::from_str(&line).expect("json");
        value["text"].as_str().expect("text").to_owned()
    };
    let prompts = [
        "ROMEO:",
        "JULIET:\nO",
        "First Citizen:",
        "KING",
        "To be",
        "MENENIUS:\nWhy",
    ];
    let alone: Vec<String> = prompts.iter().map(|p| run(&host, p)).collect();
    let together: Vec<String> = std::thread::scope(|scope| {
        // a guest cancelled mid-generation, beside the others
        let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cancelled = {
            let (host, cancel, module) = (host.clone(), cancel.clone(), &module);
            scope.spawn(move || {
                let options = RunOptions {
                    args: vec!["--max-tokens".into(), "400".into(), "HAMLET:".into()],
                    capture: Some(1 << 20),
                    cancel: Some(cancel),
                    ..Default::default()
                };
                host.run(module, "gpt2.wasm", &options)
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(150));
        cancel.store(true, std::sync::atomic::Ordering::Relaxed);
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let host = host.clone();
                let run = &run;
                scope.spawn(move || run(&host, p))
            })
            .collect();
        let texts = handles
            .into_iter()
            .map(|h| h.join().expect("guest"))
            .collect();
        let outcome = cancelled.join().expect("cancelled guest");
        assert!(
            matches!(outcome, Err(wasi_nn_host::HostError::Cancelled)),
            "{outcome:?}"
        );
        texts
    });
    assert_eq!(together, alone);
}

/// A model whose step only counts positions, taking about `step_us`: for the batcher's
/// scheduling alone.
struct Counting {
    step_us: u64,
}

struct Positions(usize);

impl SeqState for Positions {
    fn len(&self) -> usize {
        self.0
    }
    fn truncate(&mut self, len: usize) {
        self.0 = self.0.min(len);
    }
    fn last_logits(&self) -> Result<Vec<f32>, EngineError> {
        Ok(vec![self.0 as f32])
    }
    fn all_logits(&self) -> Result<Vec<f32>, EngineError> {
        Ok(vec![self.0 as f32])
    }
    fn argmax(&self) -> Result<u32, EngineError> {
        Ok(self.0 as u32)
    }
}

impl BatchModel for Counting {
    type Seq = Positions;
    fn new_seq(&self) -> Result<Positions, EngineError> {
        Ok(Positions(0))
    }
    fn step(&self, items: &mut [StepItem<'_, Positions>]) {
        let until = std::time::Instant::now() + std::time::Duration::from_micros(self.step_us);
        while std::time::Instant::now() < until {
            std::hint::spin_loop();
        }
        for item in items.iter_mut() {
            if item.tokens.contains(&u32::MAX) {
                item.error = Some(EngineError::device("refused"));
            } else {
                item.seq.0 += item.tokens.len();
            }
        }
    }
}

#[test]
fn contexts_in_lockstep_never_wait_for_each_other_forever() {
    // Contexts that step together (a barrier between steps), one of them now and then
    // sending a refused call and then its step alone, and one leaving halfway: the pattern
    // that once left a context parked with no one to wake it (the gatherer's own request was
    // taken by another step while a third context waited behind it). Every context must
    // finish; a watchdog turns a lost wake-up into a failure instead of a hung test.
    use wasi_nn_host::engine::batch::Batcher;
    const CONTEXTS: usize = 6;
    const STEPS: usize = 1500;
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let batcher = Batcher::new(Counting { step_us: 30 }, 128);
        let barrier = Barrier::new(CONTEXTS);
        let lens: Vec<usize> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..CONTEXTS)
                .map(|i| {
                    let (batcher, barrier) = (&batcher, &barrier);
                    scope.spawn(move || {
                        let mut session = Some(batcher.session().expect("session"));
                        let mut len = 0;
                        for step in 0..STEPS {
                            barrier.wait();
                            if i == 2 && step == STEPS / 2 {
                                session = None;
                            }
                            let Some(s) = session.as_mut() else { continue };
                            let tokens: Vec<u32> = match step {
                                0 => vec![1; 3 + i],
                                _ => vec![1],
                            };
                            if i == 0 && step % 7 == 3 {
                                assert!(s.extend(&[u32::MAX], false).is_err());
                            }
                            s.extend(&tokens, false).expect("step");
                            len = s.len();
                        }
                        len
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("context"))
                .collect()
        });
        let _ = done.send(lens);
    });
    let lens = finished
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("every context finishes (a context waited forever for a step)");
    for (i, len) in lens.iter().enumerate() {
        let steps = if i == 2 { STEPS / 2 } else { STEPS };
        assert_eq!(*len, 3 + i + steps - 1, "context {i}");
    }
}

/// A model that marks the items of token 9 late (as if their rows ran on past the step) and
/// takes 5 ms for such a step; a step with token 7 takes 50 ms.
struct MarksLate;

impl BatchModel for MarksLate {
    type Seq = Positions;
    fn new_seq(&self) -> Result<Positions, EngineError> {
        Ok(Positions(0))
    }
    fn step(&self, items: &mut [StepItem<'_, Positions>]) {
        for item in items.iter_mut() {
            match item.tokens {
                [7] => std::thread::sleep(std::time::Duration::from_millis(50)),
                [9] => {
                    item.deferred = true;
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                _ => {}
            }
            item.seq.0 += item.tokens.len();
        }
    }
}

#[test]
fn a_step_does_not_wait_for_contexts_whose_rows_ran_late() {
    // B and C share a step in which C's rows run late. B comes straight back; C does not come
    // back before B's next step is done. That step must not wait for C (no time spent
    // gathering): C's guest is still waiting for its rows.
    use wasi_nn_host::engine::batch::Batcher;
    let batcher = Batcher::new(MarksLate, 128);
    let (b_done, b_is_done) = std::sync::mpsc::channel();
    let batcher = &batcher;
    let (gathered_before, gathered_after) = std::thread::scope(|scope| {
        // A's slow step: B and C queue meanwhile, and then share the next one
        scope.spawn(|| {
            let mut a = batcher.session().expect("session");
            a.extend(&[7], false).expect("step");
        });
        std::thread::sleep(std::time::Duration::from_millis(10));
        let c = scope.spawn(move || {
            let mut c = batcher.session().expect("session");
            c.extend(&[9], false).expect("step");
            b_is_done.recv().expect("B's steps");
            c.extend(&[1], false).expect("step");
            c.len()
        });
        let b = scope.spawn(move || {
            let mut b = batcher.session().expect("session");
            b.extend(&[1], false).expect("step");
            let before = batcher.counts().gather_seconds;
            b.extend(&[1], false).expect("step");
            let after = batcher.counts().gather_seconds;
            b_done.send(()).expect("C waits");
            (before, after)
        });
        let gathered = b.join().expect("B");
        assert_eq!(c.join().expect("C"), 2);
        gathered
    });
    assert_eq!(batcher.counts().largest, 2, "B and C shared a step");
    assert_eq!(
        gathered_after, gathered_before,
        "B's step waited for C, whose rows ran late"
    );
}

/// A model with a result ready for token 5 (as if run ahead and finished): taken without a
/// step. Token 7 takes 50 ms.
struct ReadyFive;

impl BatchModel for ReadyFive {
    type Seq = Positions;
    fn new_seq(&self) -> Result<Positions, EngineError> {
        Ok(Positions(0))
    }
    fn take_precomputed(&self, seq: &mut Positions, tokens: &[u32], all_positions: bool) -> bool {
        let ready = tokens == [5] && !all_positions;
        if ready {
            seq.0 += 1;
        }
        ready
    }
    fn step(&self, items: &mut [StepItem<'_, Positions>]) {
        for item in items.iter_mut() {
            if item.tokens == [7] {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            item.seq.0 += item.tokens.len();
        }
    }
}

#[test]
fn a_result_ready_is_taken_without_a_step_and_no_step_waits_for_it() {
    // A and B share a slow step; B's next call has its result ready: it takes it without a
    // step, and A's next step does not wait for B to come back.
    use wasi_nn_host::engine::batch::Batcher;
    let batcher = Batcher::new(ReadyFive, 128);
    let batcher = &batcher;
    let (b_took, b_has_taken) = std::sync::mpsc::channel();
    let (a_stepped, a_has_stepped) = std::sync::mpsc::channel();
    let (steps, gathered) = std::thread::scope(|scope| {
        // X's slow step: A and B queue meanwhile, and then share the next one
        scope.spawn(|| {
            let mut x = batcher.session().expect("session");
            x.extend(&[7], false).expect("step");
        });
        std::thread::sleep(std::time::Duration::from_millis(10));
        let b = scope.spawn(move || {
            let mut b = batcher.session().expect("session");
            b.extend(&[7], false).expect("step");
            let steps = batcher.counts().steps;
            b.extend(&[5], false).expect("ready");
            assert_eq!(b.len(), 2);
            let after = batcher.counts().steps;
            b_took.send(()).expect("A waits");
            // B stays open (a context dropped is not waited for either)
            a_has_stepped.recv().expect("A's step");
            (steps, after)
        });
        let a = scope.spawn(move || {
            let mut a = batcher.session().expect("session");
            a.extend(&[7], false).expect("step");
            b_has_taken.recv().expect("B took its result");
            let before = batcher.counts().gather_seconds;
            a.extend(&[1], false).expect("step");
            assert_eq!(a.len(), 2);
            a_stepped.send(()).expect("B waits");
            batcher.counts().gather_seconds - before
        });
        (b.join().expect("B"), a.join().expect("A"))
    });
    assert_eq!(batcher.counts().largest, 2, "A and B shared a step");
    assert_eq!(steps.0, steps.1, "B's ready result took a step");
    assert_eq!(
        gathered, 0.0,
        "A's step waited for B, which took its result"
    );
}

/// A model that runs prompts among company in chunks of 4 tokens and records every step's
/// items (tokens each).
#[derive(Default)]
struct ChunksOfFour {
    steps: std::sync::Mutex<Vec<Vec<usize>>>,
}

impl BatchModel for ChunksOfFour {
    type Seq = Positions;
    fn max_chunk(&self, _all_positions: bool, company: usize) -> usize {
        if company == 0 {
            usize::MAX
        } else {
            4
        }
    }
    fn new_seq(&self) -> Result<Positions, EngineError> {
        Ok(Positions(0))
    }
    fn step(&self, items: &mut [StepItem<'_, Positions>]) {
        std::thread::sleep(std::time::Duration::from_micros(200));
        let sizes = items.iter().map(|i| i.tokens.len()).collect();
        self.steps.lock().expect("steps").push(sizes);
        for item in items.iter_mut() {
            item.seq.0 += item.tokens.len();
        }
    }
}

#[test]
fn a_prompt_among_decoding_contexts_runs_in_chunks_beside_them_and_alone_whole() {
    use wasi_nn_host::engine::batch::Batcher;
    let batcher = Batcher::new(ChunksOfFour::default(), 128);
    let batcher = &batcher;
    // alone: the prompt runs whole, in one step
    let mut lone = batcher.session().expect("session");
    lone.extend(&[1; 10], false).expect("prompt");
    drop(lone);
    let steps = |b: &Batcher<ChunksOfFour>| b.model().steps.lock().expect("steps").clone();
    assert_eq!(steps(batcher), vec![vec![10]]);

    // beside a context decoding step after step (until the prompt is in, however slowly this
    // thread gets there): chunks of at most 4, each step keeping the decode, and the prompt's
    // positions all there
    let started = std::sync::Barrier::new(2);
    let (started, prompt_in) = (&started, &std::sync::atomic::AtomicBool::new(false));
    std::thread::scope(|scope| {
        let decoding = scope.spawn(move || {
            let mut d = batcher.session().expect("session");
            for i in 0.. {
                d.extend(&[1], false).expect("decode");
                if i == 2 {
                    started.wait();
                }
                if i >= 2 && prompt_in.load(std::sync::atomic::Ordering::Acquire) {
                    break;
                }
                assert!(i < 100_000, "the prompt never came in");
            }
        });
        started.wait();
        let mut p = batcher.session().expect("session");
        p.extend(&[1; 10], false).expect("prompt");
        prompt_in.store(true, std::sync::atomic::Ordering::Release);
        assert_eq!(p.len(), 10);
        decoding.join().expect("decoding");
    });
    let after = steps(batcher)[1..].to_vec();
    let prompt_steps: Vec<&Vec<usize>> =
        after.iter().filter(|s| s.iter().any(|&n| n > 1)).collect();
    let chunks: Vec<usize> = prompt_steps
        .iter()
        .flat_map(|s| s.iter().copied().filter(|&n| n > 1))
        .collect();
    assert!(chunks.iter().all(|&n| n <= 4), "{after:?}");
    assert!(chunks.iter().sum::<usize>() >= 8, "{after:?}");
    // (a step may run before the decoding context is back, so not every one need have it)
    assert!(
        prompt_steps.iter().any(|s| s.contains(&1)),
        "no chunk ran beside the decode: {after:?}"
    );
}

#[test]
fn a_slow_guest_does_not_hold_the_others() {
    // A and B step together; then B's guest takes 100 ms before each of its calls (a slow
    // sampler), while A's comes straight back. A's steps wait for B at most the gather's
    // bound each (2 ms), not B's 100 ms: A's 20 steps end long before B's 5.
    use wasi_nn_host::engine::batch::Batcher;
    let batcher = Batcher::new(Counting { step_us: 200 }, 128);
    let batcher = &batcher;
    let start = std::sync::Barrier::new(2);
    let start = &start;
    let (a_took, b_took) = std::thread::scope(|scope| {
        let a = scope.spawn(move || {
            let mut a = batcher.session().expect("session");
            a.extend(&[1, 2, 3], false).expect("prompt");
            start.wait();
            let began = std::time::Instant::now();
            for _ in 0..20 {
                a.extend(&[1], false).expect("step");
            }
            assert_eq!(a.len(), 23);
            began.elapsed()
        });
        let b = scope.spawn(move || {
            let mut b = batcher.session().expect("session");
            b.extend(&[1, 2], false).expect("prompt");
            start.wait();
            let began = std::time::Instant::now();
            for _ in 0..5 {
                std::thread::sleep(std::time::Duration::from_millis(100));
                b.extend(&[1], false).expect("step");
            }
            assert_eq!(b.len(), 7);
            began.elapsed()
        });
        (a.join().expect("A"), b.join().expect("B"))
    });
    assert!(
        b_took >= std::time::Duration::from_millis(500),
        "{b_took:?}"
    );
    assert!(
        a_took < std::time::Duration::from_millis(250),
        "A's 20 steps took {a_took:?}: they waited for the slow guest"
    );
}
