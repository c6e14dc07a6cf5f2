//! State that libraries keep per stream (a cuBLAS handle), owned by the backend's stream.
//!
//! A library call ([`LibraryCall`](super::LibraryCall)) asks for its state by type: the first
//! call on a stream makes it, later calls on that stream get the same value, and it is dropped
//! with the stream. The backend drops it after the stream's pending work has completed, with
//! the stream's context current (see [`LibraryState::take`]), so a state whose drop calls into
//! its library (destroying a handle) may rely on both. A library keys its state by a type of
//! its own, so two libraries never see each other's state.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// One state: its own lock, so the map is not held while a library uses it.
type Slot = Arc<Mutex<Box<dyn Any + Send>>>;

/// The library states of one stream, by type.
#[derive(Default)]
pub(crate) struct LibraryState {
    slots: Mutex<HashMap<TypeId, Slot>>,
}

impl LibraryState {
    /// Runs `f` on the stream's state of type `T`, made by `init` on first use (under the map's
    /// lock, so once per stream; an `init` that fails leaves nothing behind). `f` holds the
    /// state's lock: calls on one stream from two threads take turns, and `f` must not ask for
    /// the same type again.
    pub(crate) fn with<T: Any + Send, R>(
        &self,
        init: impl FnOnce() -> Result<T>,
        f: impl FnOnce(&mut T) -> Result<R>,
    ) -> Result<R> {
        let slot = {
            let mut slots = self.slots.lock();
            match slots.get(&TypeId::of::<T>()) {
                Some(s) => s.clone(),
                None => {
                    let s: Slot = Arc::new(Mutex::new(Box::new(init()?)));
                    slots.insert(TypeId::of::<T>(), s.clone());
                    s
                }
            }
        };
        let mut guard = slot.lock();
        let state = guard.downcast_mut::<T>().ok_or_else(|| Error::Internal {
            what: format!(
                "the library state of {} has another type",
                std::any::type_name::<T>()
            ),
        })?;
        f(state)
    }

    /// Whether no library has made a state on this stream.
    pub(crate) fn is_empty(&self) -> bool {
        self.slots.lock().is_empty()
    }

    /// Takes every state out, for the backend to drop when it is safe to (no work of the stream
    /// pending, its context current). Nothing else holds a state then: a call borrows the
    /// stream, so none runs while the stream is being dropped.
    pub(crate) fn take(&mut self) -> Vec<Box<dyn Any + Send>> {
        self.slots
            .get_mut()
            .drain()
            .map(|(_, s)| match Arc::try_unwrap(s) {
                Ok(m) => m.into_inner(),
                // Unreachable (see above); keep the state alive rather than drop it elsewhere.
                Err(shared) => Box::new(shared),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Counted(&'static AtomicUsize, u32);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_state_is_made_once_kept_per_type_and_dropped_when_taken() {
        static DROPS: AtomicUsize = AtomicUsize::new(0);
        let mut st = LibraryState::default();
        assert!(st.is_empty());
        let mut inits = 0;
        for i in 0..3 {
            let got = st
                .with(
                    || {
                        inits += 1;
                        Ok(Counted(&DROPS, 0))
                    },
                    |c: &mut Counted| {
                        c.1 += 1;
                        Ok(c.1)
                    },
                )
                .unwrap();
            assert_eq!(got, i + 1);
        }
        assert_eq!(inits, 1);
        // another type is another state
        let v = st.with(|| Ok(7u64), |v: &mut u64| Ok(*v)).unwrap();
        assert_eq!(v, 7);
        assert_eq!(DROPS.load(Ordering::SeqCst), 0);
        let taken = st.take();
        assert_eq!(taken.len(), 2);
        assert!(st.is_empty());
        drop(taken);
        assert_eq!(DROPS.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_failed_init_leaves_nothing() {
        let st = LibraryState::default();
        let e = st.with(
            || Err::<u32, _>(Error::InvalidArgument("no".into())),
            |_| Ok(()),
        );
        assert!(e.is_err());
        assert!(st.is_empty());
        assert_eq!(st.with(|| Ok(3u32), |v| Ok(*v)).unwrap(), 3);
    }
}
