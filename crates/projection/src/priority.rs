//! CPU priority of background work. Applying the log and writing checkpoints use
//! most of the CPU under ingest, and nothing waits on one of them for more than a
//! chunk; a query waits for the CPU they take. So the threads that do them run at
//! a lower priority (a higher nice value) than the threads that answer requests:
//! on a saturated machine the scheduler then hands the core to a query first
//! (ARCHITECTURE.md, "tally-projection"). The work is not starved: when the
//! request threads idle, it runs at full speed, and the ingest backpressure
//! (events appended but not applied) stops new work before apply falls far behind.

/// The nice value of background threads: such a thread weighs about a tenth of a
/// request thread when both want a core (the kernel's weights fall ~1.25x per
/// step). Measured under the ingest benchmark (docs/benchmarks.md, "Background work yields
/// the CPU to requests"): 10 and 19 cut the usage query's p99 alike, 5 less.
pub const BACKGROUND_NICE: i32 = 10;

/// Lowers the calling thread's CPU priority to [`BACKGROUND_NICE`]. On Linux the
/// nice value belongs to the thread, so only this thread (and threads it starts)
/// is affected; a thread already lower keeps its value. Raising it back needs a
/// privilege, so call this only on a thread that does background work for its
/// whole life. A failure (a system that refuses) changes nothing but the
/// scheduling: the caller logs it, never fails on it.
pub fn run_as_background_thread() -> Result<(), String> {
    #[cfg(target_os = "linux")]
    {
        let this_thread = Some(rustix::thread::gettid());
        let now = rustix::process::getpriority_process(this_thread)
            .map_err(|error| format!("reading the thread's nice value: {error}"))?;
        if now >= BACKGROUND_NICE {
            // Started lower still (`nice -n 15 tally serve`): raising it would
            // need a privilege, and the operator chose it.
            return Ok(());
        }
        rustix::process::setpriority_process(this_thread, BACKGROUND_NICE)
            .map_err(|error| format!("setting the thread's nice value: {error}"))
    }
    #[cfg(not(target_os = "linux"))]
    {
        Ok(())
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use rustix::process::getpriority_process;
    use rustix::thread::gettid;

    #[test]
    fn only_the_calling_thread_is_lowered() {
        let before = getpriority_process(Some(gettid())).unwrap();
        let lowered = std::thread::spawn(|| {
            run_as_background_thread().unwrap();
            getpriority_process(Some(gettid())).unwrap()
        })
        .join()
        .unwrap();
        // Already at or past it (a niced test run) the call keeps the higher value.
        assert_eq!(lowered, BACKGROUND_NICE.max(before));
        assert_eq!(getpriority_process(Some(gettid())).unwrap(), before);
    }
}
