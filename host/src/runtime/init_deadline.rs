//! The time an init function may take when a guest is pre-initialised: `serve` runs a plain
//! component's at start, and a loop there must not hang the start. The init runs in an engine
//! with epoch interruption, and a timer thread moves the epoch past the store's deadline once
//! the limit has passed.

use std::sync::mpsc;
use std::time::Duration;
use wasmtime::{Config, Engine};

/// How long an init function may run before pre-initialisation gives it up.
pub const INIT_TIME_LIMIT: Duration = Duration::from_secs(60);

/// An engine for an init function, which [`InitDeadline`] can interrupt.
pub(super) fn init_engine() -> wasmtime::Result<Engine> {
    let mut config = Config::new();
    config.epoch_interruption(true);
    Engine::new(&config)
}

/// Interrupts the init functions of `engine`'s stores (their epoch deadline one tick away)
/// once `limit` has passed, unless dropped first.
pub(super) struct InitDeadline {
    done: Option<mpsc::Sender<()>>,
    timer: Option<std::thread::JoinHandle<()>>,
}

impl InitDeadline {
    pub(super) fn start(engine: &Engine, limit: Duration) -> Self {
        let (done, finished) = mpsc::channel::<()>();
        let engine = engine.clone();
        let timer = std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = finished.recv_timeout(limit) {
                engine.increment_epoch();
            }
        });
        InitDeadline {
            done: Some(done),
            timer: Some(timer),
        }
    }
}

impl Drop for InitDeadline {
    fn drop(&mut self) {
        // the timer sees the channel closed and ends
        drop(self.done.take());
        if let Some(timer) = self.timer.take() {
            let _ = timer.join();
        }
    }
}
