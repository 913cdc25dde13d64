//! A partition's watermark (every record below it is applied and readable) and the
//! tasks waiting for it to pass an offset.
//!
//! Why not a `tokio::sync::watch`: every publish of a watch wakes every receiver,
//! and a request waiting for its own record's outcome was polled again (through
//! its whole HTTP future) on every chunk the projector committed, only to find its
//! offset not reached yet. With 64 debits in flight and chunks of a few records,
//! that was a few dozen wake-ups per debit. Here a waiter is filed under the
//! offset it waits for, and a publish wakes exactly the waiters it passed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tokio::sync::oneshot;

/// Waiters by the offset they wait for (the watermark must pass it).
type Waiters = BTreeMap<u64, Vec<oneshot::Sender<()>>>;

#[derive(Debug)]
pub(crate) struct Watermark {
    /// The next offset to apply: every record below it is applied.
    next: AtomicU64,
    waiters: Mutex<Waiters>,
}

/// What a waiter holds: resolved once the watermark passes its offset, or closed
/// when the watermark is dropped or its waiters are released.
pub(crate) type Passed = oneshot::Receiver<()>;

impl Watermark {
    pub(crate) fn new(next: u64) -> Watermark {
        Watermark {
            next: AtomicU64::new(next),
            waiters: Mutex::new(BTreeMap::new()),
        }
    }

    pub(crate) fn get(&self) -> u64 {
        self.next.load(Ordering::SeqCst)
    }

    fn waiters(&self) -> std::sync::MutexGuard<'_, Waiters> {
        // A waiter list holds no invariant a panic could break half-way.
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the watermark to `next` and wakes the waiters it passed.
    pub(crate) fn publish(&self, next: u64) {
        // Stored before the list is locked: a waiter that files itself after this
        // drain found the new value already (`wait_past` checks under the lock).
        self.next.store(next, Ordering::SeqCst);
        let passed = {
            let mut waiters = self.waiters();
            let still_waiting = waiters.split_off(&next);
            std::mem::replace(&mut *waiters, still_waiting)
        };
        for sender in passed.into_values().flatten() {
            let _ = sender.send(());
        }
    }

    /// `None` when the watermark is past `offset` already; else what resolves
    /// when it passes.
    pub(crate) fn wait_past(&self, offset: u64) -> Option<Passed> {
        if self.get() > offset {
            return None;
        }
        let mut waiters = self.waiters();
        if self.get() > offset {
            return None;
        }
        let (sender, receiver) = oneshot::channel();
        let at = waiters.entry(offset).or_default();
        // Waiters that gave up (timed out, or their request was dropped) leave
        // their sender behind; the first new waiter of the offset sweeps them, so
        // a stalled watermark keeps no more than the live waiters.
        at.retain(|s| !s.is_closed());
        at.push(sender);
        Some(receiver)
    }

    /// Wakes every waiter without moving the watermark (the projector stopped:
    /// each waiter checks why).
    pub(crate) fn release_all(&self) {
        // Taken under the lock, dropped after it (the guard ends with the `let`):
        // each sender's drop wakes its waiter.
        let all = std::mem::take(&mut *self.waiters());
        drop(all);
    }

    /// How many waiters are filed (tests).
    #[cfg(test)]
    fn filed(&self) -> usize {
        self.waiters().values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_publish_wakes_exactly_the_waiters_it_passed() {
        let mark = Watermark::new(5);
        assert!(mark.wait_past(4).is_none(), "offset 4 is applied already");
        let at_5 = mark.wait_past(5).expect("5 is not applied");
        let mut at_9 = mark.wait_past(9).expect("9 is not applied");
        mark.publish(6);
        tokio::time::timeout(Duration::from_secs(5), at_5)
            .await
            .expect("woken")
            .expect("passed, not released");
        assert!(
            at_9.try_recv().is_err(),
            "9 must not be woken by a watermark of 6"
        );
        assert_eq!(mark.filed(), 1);
        mark.publish(10);
        tokio::time::timeout(Duration::from_secs(5), at_9)
            .await
            .expect("woken")
            .expect("passed");
        assert_eq!(mark.filed(), 0);
        assert_eq!(mark.get(), 10);
    }

    #[tokio::test]
    async fn release_wakes_every_waiter_without_passing_it() {
        let mark = Watermark::new(0);
        let waiting = mark.wait_past(3).expect("not applied");
        mark.release_all();
        assert!(waiting.await.is_err(), "released, not passed");
        assert_eq!(mark.get(), 0);
    }

    #[test]
    fn waiters_that_gave_up_are_swept() {
        let mark = Watermark::new(0);
        for _ in 0..100 {
            drop(mark.wait_past(7).expect("not applied"));
        }
        let _live = mark.wait_past(7).expect("not applied");
        assert_eq!(mark.filed(), 1);
    }

    #[test]
    fn waiters_racing_publishes_are_never_lost() {
        // Waiters filed from other threads while the watermark moves: each is
        // either answered at once or woken by a later publish, never left behind.
        let mark = std::sync::Arc::new(Watermark::new(0));
        let waiter = {
            let mark = mark.clone();
            std::thread::spawn(move || {
                let mut pending = Vec::new();
                for offset in 0..20_000u64 {
                    if let Some(passed) = mark.wait_past(offset) {
                        pending.push(passed);
                    }
                }
                pending
            })
        };
        for next in 1..=20_000u64 {
            mark.publish(next);
        }
        for mut passed in waiter.join().expect("no panic") {
            assert!(passed.try_recv().is_ok(), "a waiter was left behind");
        }
    }
}
