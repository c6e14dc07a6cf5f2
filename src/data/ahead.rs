//! Batches prepared ahead of the step on worker threads (see [`Ahead`]).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{bounded, Receiver, RecvError};

use crate::error::{Error, Result};

/// What an [`Ahead`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AheadStats {
    /// Items handed to the consumer.
    pub delivered: u64,
    /// Calls to [`Ahead::recv`] that found their item not yet built and waited for it: the
    /// steps the data was late for.
    pub waited: u64,
}

/// The builder of an indexed stream.
type Builder<T> = Arc<dyn Fn(u64) -> Result<T> + Send + Sync>;

/// Batches prepared ahead of the step on worker threads, delivered in order through a bounded
/// queue.
///
/// A trainer that builds each batch on its own thread between two device steps leaves the
/// device idle for as long as that takes. [`Ahead`] runs the building on worker threads
/// while the trainer steps: [`Ahead::indexed`] for sources where batch `i` is a pure function
/// of `i` (the synthetic Criteo generator, the text batches), split over several workers, and
/// [`Ahead::sequential`] for a stream read in order (a TSV file), on one worker. Either way the
/// trainer receives the same items in the same order as building them itself, so training is
/// bitwise the same; at most `depth` items wait built, so memory stays bounded.
///
/// A trainer whose next index is not always the previous plus one (a step skipped for a loss
/// scale overflow trains its batch again) asks an indexed stream for item `i` by
/// [`Ahead::at`]: an index behind the stream is built on the calling thread by the same
/// builder, one ahead of it skips the items in between.
///
/// An error from the builder arrives at its position in the order and ends the stream; a
/// builder that panics ends it with [`Error::Poisoned`]. Dropping an [`Ahead`] stops and joins
/// its workers.
///
/// ```
/// use tidemem::data::Ahead;
/// # fn main() -> tidemem::Result<()> {
/// // squares of 0..10 built by 2 workers, at most 4 waiting
/// let mut a = Ahead::indexed(0..10, 4, 2, |i| Ok(i * i))?;
/// let mut got = Vec::new();
/// while let Some(x) = a.recv()? {
///     got.push(x);
/// }
/// assert_eq!(got, (0..10).map(|i| i * i).collect::<Vec<u64>>());
/// # Ok(())
/// # }
/// ```
pub struct Ahead<T> {
    /// An indexed stream's builder and range (none for a sequential one).
    indexed: Option<(Builder<T>, Range<u64>)>,
    /// One queue per worker; item `k` of the stream comes from queue `k % queues.len()`.
    queues: Vec<Receiver<Result<T>>>,
    next: u64,
    done: bool,
    stop: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
    waited: u64,
    /// Items the workers have built (for tests of the bound).
    built: Arc<AtomicU64>,
}

impl<T: Send + 'static> Ahead<T> {
    /// Items `make(i)` for `i` in `range`, in order, built by `workers` threads (worker `w`
    /// builds every `workers`-th index from `range.start + w`), at most about `depth` waiting
    /// (each worker holds up to `ceil(depth / workers)`).
    ///
    /// # Errors
    /// [`Error::TooFew`] for a `depth` or `workers` of 0; [`Error::ThreadSpawn`] when a
    /// worker cannot start (those started are stopped first).
    pub fn indexed<F>(range: Range<u64>, depth: usize, workers: usize, make: F) -> Result<Self>
    where
        F: Fn(u64) -> Result<T> + Send + Sync + 'static,
    {
        check(depth, workers)?;
        let workers = workers
            .min(usize::try_from(range.end.saturating_sub(range.start)).unwrap_or(usize::MAX))
            .max(1);
        let per = depth.div_ceil(workers);
        let make = Arc::new(make);
        let mut a = Ahead::empty();
        a.indexed = Some((make.clone() as Builder<T>, range.clone()));
        for w in 0..workers {
            let (tx, rx) = bounded(per);
            let (make, stop, built) = (make.clone(), a.stop.clone(), a.built.clone());
            let first = range.start.saturating_add(w as u64);
            let (end, step) = (range.end, workers as u64);
            a.spawn(w, rx, move || {
                let mut i = first;
                while i < end && !stop.load(Ordering::Relaxed) {
                    let item = make(i);
                    let failed = item.is_err();
                    built.fetch_add(1, Ordering::Relaxed);
                    if tx.send(item).is_err() || failed {
                        return;
                    }
                    i = match i.checked_add(step) {
                        Some(n) => n,
                        None => return,
                    };
                }
            })?;
        }
        Ok(a)
    }

    /// The items `next()` returns until it returns `Ok(None)` or an error, in order, built on
    /// one worker thread, at most `depth` waiting.
    ///
    /// # Errors
    /// [`Error::TooFew`] for a `depth` of 0; [`Error::ThreadSpawn`] when the worker
    /// cannot start.
    pub fn sequential<F>(depth: usize, mut next: F) -> Result<Self>
    where
        F: FnMut() -> Result<Option<T>> + Send + 'static,
    {
        check(depth, 1)?;
        let mut a = Ahead::empty();
        let (tx, rx) = bounded(depth);
        let (stop, built) = (a.stop.clone(), a.built.clone());
        a.spawn(0, rx, move || {
            while !stop.load(Ordering::Relaxed) {
                let item = match next() {
                    Ok(Some(x)) => Ok(x),
                    Ok(None) => return,
                    Err(e) => Err(e),
                };
                let failed = item.is_err();
                built.fetch_add(1, Ordering::Relaxed);
                if tx.send(item).is_err() || failed {
                    return;
                }
            }
        })?;
        Ok(a)
    }

    fn empty() -> Self {
        Ahead {
            indexed: None,
            queues: Vec::new(),
            next: 0,
            done: false,
            stop: Arc::new(AtomicBool::new(false)),
            workers: Vec::new(),
            waited: 0,
            built: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Starts worker `w` running `body`, its items arriving on `rx`.
    fn spawn(
        &mut self,
        w: usize,
        rx: Receiver<Result<T>>,
        body: impl FnOnce() + Send + 'static,
    ) -> Result<()> {
        let h = std::thread::Builder::new()
            .name(format!("tidemem-data-{w}"))
            .spawn(body)
            .map_err(|source| Error::ThreadSpawn {
                what: format!("data worker {w}"),
                source,
            })?;
        self.queues.push(rx);
        self.workers.push(h);
        Ok(())
    }

    /// The next item, waiting for it if it is not built yet; `Ok(None)` at the end of the
    /// stream, and after an error.
    ///
    /// # Errors
    /// The builder's error for this item (the stream ends there), or [`Error::Poisoned`] when
    /// the worker building it panicked.
    pub fn recv(&mut self) -> Result<Option<T>> {
        if self.done || self.queues.is_empty() {
            return Ok(None);
        }
        let q = &self.queues[(self.next % self.queues.len() as u64) as usize];
        let got = match q.try_recv() {
            Ok(x) => Ok(x),
            Err(_) => {
                self.waited += 1;
                q.recv()
            }
        };
        match got {
            Ok(Ok(x)) => {
                self.next += 1;
                Ok(Some(x))
            }
            Ok(Err(e)) => {
                self.finish();
                Err(e)
            }
            Err(RecvError) => {
                // the worker ended: the end of the stream, or a panic
                let panicked = self.finish();
                match panicked {
                    Some(reason) => Err(Error::Poisoned {
                        what: "data loader",
                        reason,
                    }),
                    None => Ok(None),
                }
            }
        }
    }

    /// Item `index` of an indexed stream ([`Ahead::indexed`]): from the queue when it is the
    /// stream's next; built here by the same builder when the stream has passed it (a repeated
    /// index); the items in between skipped when it lies ahead. Indices outside the stream's
    /// range are built here too.
    ///
    /// # Errors
    /// The builder's error; [`Error::Conflict`] on a sequential stream; as
    /// [`Ahead::recv`] for an item from the queue.
    pub fn at(&mut self, index: u64) -> Result<T> {
        let Some((make, range)) = self.indexed.clone() else {
            return Err(Error::Conflict {
                what: "items by index (Ahead::at)".into(),
                with: "a sequential data stream".into(),
            });
        };
        if !range.contains(&index) || index < range.start + self.next || self.done {
            return make(index);
        }
        while range.start + self.next < index {
            if self.recv()?.is_none() {
                return make(index);
            }
        }
        match self.recv()? {
            Some(x) => Ok(x),
            None => make(index),
        }
    }

    /// What was delivered, and how often the consumer waited.
    pub fn stats(&self) -> AheadStats {
        AheadStats {
            delivered: self.next,
            waited: self.waited,
        }
    }

    /// Items the workers have built so far (delivered, waiting, or dropped at the end).
    pub fn built(&self) -> u64 {
        self.built.load(Ordering::Relaxed)
    }

    /// Stops and joins the workers; the first panic's message, if one panicked.
    fn finish(&mut self) -> Option<String> {
        self.done = true;
        self.stop.store(true, Ordering::Relaxed);
        // dropping the receivers wakes a worker blocked on a full queue
        self.queues.clear();
        let mut panicked = None;
        for h in self.workers.drain(..) {
            if let Err(p) = h.join() {
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a data worker panicked".into());
                panicked.get_or_insert(format!("a data worker panicked: {msg}"));
            }
        }
        panicked
    }
}

impl<T> Drop for Ahead<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.queues.clear();
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

fn check(depth: usize, workers: usize) -> Result<()> {
    for (what, n) in [("depth", depth), ("workers", workers)] {
        if n == 0 {
            return Err(Error::TooFew {
                what: format!("{what} of a data queue (depth {depth} over {workers} workers)"),
                got: 0,
                need: 1,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn drain<T: Send + 'static>(a: &mut Ahead<T>) -> Result<Vec<T>> {
        let mut v = Vec::new();
        while let Some(x) = a.recv()? {
            v.push(x);
        }
        Ok(v)
    }

    #[test]
    fn indexed_items_arrive_in_order_whatever_the_workers() {
        for workers in [1, 2, 3, 7] {
            for depth in [1, 2, 5] {
                let mut a = Ahead::indexed(5..40, depth, workers, |i| {
                    // later indices finish first on some workers
                    std::thread::sleep(Duration::from_micros(40 - i));
                    Ok(i * 3)
                })
                .unwrap();
                let got = drain(&mut a).unwrap();
                assert_eq!(got, (5..40).map(|i| i * 3).collect::<Vec<_>>());
                assert_eq!(a.stats().delivered, 35);
                assert_eq!(a.recv().unwrap(), None, "the end stays the end");
            }
        }
        let mut a = Ahead::indexed(3..3, 2, 2, Ok).unwrap();
        assert_eq!(a.recv().unwrap(), None);
    }

    /// Waits (up to 10 s) until `a` has built `n` items.
    fn until_built<T: Send + 'static>(a: &Ahead<T>, n: u64) {
        let t = std::time::Instant::now();
        while a.built() < n && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn no_more_than_the_depth_waits_built() {
        for (depth, workers) in [(1, 1), (4, 1), (4, 2), (6, 3)] {
            let mut a = Ahead::indexed(0..1000, depth, workers, Ok).unwrap();
            assert_eq!(a.recv().unwrap(), Some(0));
            // each worker: its queue full, and one item built but blocked in send
            let bound = 1 + (depth.div_ceil(workers) + 1) * workers;
            until_built(&a, 1 + depth as u64);
            std::thread::sleep(Duration::from_millis(20));
            assert!(
                (1 + depth..=bound).contains(&(a.built() as usize)),
                "depth {depth}, {workers} workers: {} built, the queue full and at most {bound}",
                a.built()
            );
        }
        let mut n = 0;
        let mut s = Ahead::sequential(3, move || {
            n += 1;
            Ok(Some(n))
        })
        .unwrap();
        assert_eq!(s.recv().unwrap(), Some(1));
        until_built(&s, 4);
        std::thread::sleep(Duration::from_millis(20));
        assert!((4..=5).contains(&s.built()), "{} built", s.built());
    }

    #[test]
    fn sequential_items_arrive_in_order_and_end() {
        let mut v = (0..100u32).collect::<Vec<_>>().into_iter();
        let mut a = Ahead::sequential(4, move || Ok(v.next())).unwrap();
        assert_eq!(drain(&mut a).unwrap(), (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn an_error_arrives_at_its_place_and_ends_the_stream() {
        let mut a = Ahead::indexed(0..50, 4, 3, |i| {
            if i == 17 {
                Err(Error::Io {
                    during: "building an item",
                    source: std::io::Error::other(format!("bad item {i}")),
                })
            } else {
                Ok(i)
            }
        })
        .unwrap();
        for i in 0..17 {
            assert_eq!(a.recv().unwrap(), Some(i));
        }
        let e = a.recv().unwrap_err();
        assert!(e.to_string().contains("bad item 17"), "{e}");
        assert_eq!(a.recv().unwrap(), None);
        let mut k = 0;
        let mut s = Ahead::sequential(2, move || {
            k += 1;
            if k == 3 {
                Err(Error::Io {
                    during: "reading a line",
                    source: std::io::Error::other("line 3"),
                })
            } else {
                Ok(Some(k))
            }
        })
        .unwrap();
        assert_eq!(s.recv().unwrap(), Some(1));
        assert_eq!(s.recv().unwrap(), Some(2));
        assert!(s.recv().is_err());
        assert_eq!(s.recv().unwrap(), None);
    }

    #[test]
    fn a_panicking_builder_is_an_error_not_a_hang() {
        let mut a = Ahead::indexed(0..10, 2, 2, |i| {
            if i == 4 {
                panic!("builder broke at {i}");
            }
            Ok(i)
        })
        .unwrap();
        for i in 0..4 {
            assert_eq!(a.recv().unwrap(), Some(i));
        }
        match a.recv() {
            Err(Error::Poisoned { reason, .. }) => {
                assert!(reason.contains("broke at 4"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn dropping_stops_workers_blocked_on_a_full_queue() {
        let a = Ahead::indexed(0..u64::MAX, 2, 4, Ok).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        drop(a); // joins: a hang fails the test by timeout
        let s = Ahead::sequential(1, || Ok(Some(0u8))).unwrap();
        drop(s);
    }

    #[test]
    fn items_by_index_repeat_skip_and_leave_the_range() {
        let mut a = Ahead::indexed(10..100, 3, 2, |i| Ok(i * 2)).unwrap();
        assert_eq!(a.at(10).unwrap(), 20);
        assert_eq!(a.at(10).unwrap(), 20, "a repeat is built here");
        assert_eq!(a.at(11).unwrap(), 22);
        assert_eq!(a.at(15).unwrap(), 30, "12 to 14 skipped");
        assert_eq!(a.at(16).unwrap(), 32);
        assert_eq!(
            a.stats().delivered,
            7,
            "from the queue: 10, 11, 12..=15, 16"
        );
        assert_eq!(a.at(5).unwrap(), 10, "before the range");
        assert_eq!(a.at(500).unwrap(), 1000, "past the range");
        assert_eq!(a.at(17).unwrap(), 34);
        let mut s = Ahead::sequential(2, || Ok(Some(1))).unwrap();
        assert!(matches!(s.at(0), Err(Error::Conflict { .. })));
    }

    #[test]
    fn zero_depth_or_workers_is_refused() {
        assert!(matches!(
            Ahead::indexed(0..4, 0, 1, Ok),
            Err(Error::TooFew {
                got: 0,
                need: 1,
                ..
            })
        ));
        assert!(Ahead::indexed(0..4, 1, 0, Ok).is_err());
        assert!(Ahead::sequential(0, || Ok(Some(1))).is_err());
    }

    #[test]
    fn an_ahead_crosses_threads() {
        fn both<T: Send + Sync>() {}
        both::<Ahead<Vec<u8>>>();
        both::<AheadStats>();
    }
}
