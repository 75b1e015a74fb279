//! A tiny futex lock whose state we own, so that fork handlers can take every lock before
//! `fork()` and reset them in the child. `std::sync::Mutex` cannot be force-unlocked, and a lock
//! held by another thread at fork time would otherwise stay locked forever in the child.
//!
//! Only per-process memory is guarded by these locks: nothing shared between processes ever
//! waits on them, so a killed process cannot leave another one blocked.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU32, Ordering};

const UNLOCKED: u32 = 0;
const LOCKED: u32 = 1;
const CONTENDED: u32 = 2;

pub struct Lock<T> {
    state: AtomicU32,
    value: UnsafeCell<T>,
}

unsafe impl<T: Send> Sync for Lock<T> {}
unsafe impl<T: Send> Send for Lock<T> {}

pub struct Guard<'a, T> {
    lock: &'a Lock<T>,
}

impl<T> Lock<T> {
    pub const fn new(value: T) -> Self {
        Lock { state: AtomicU32::new(UNLOCKED), value: UnsafeCell::new(value) }
    }

    #[inline]
    pub fn lock(&self) -> Guard<'_, T> {
        if self
            .state
            .compare_exchange(UNLOCKED, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_slow();
        }
        Guard { lock: self }
    }

    #[cold]
    fn lock_slow(&self) {
        // Spin briefly: critical sections are a hash-map insert or remove.
        for _ in 0..64 {
            std::hint::spin_loop();
            if self
                .state
                .compare_exchange(UNLOCKED, LOCKED, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
        // Drepper's "futexes are tricky" mutex #2: mark contended, sleep until woken.
        while self.state.swap(CONTENDED, Ordering::Acquire) != UNLOCKED {
            futex_wait(&self.state, CONTENDED);
        }
    }

    #[inline]
    fn unlock(&self) {
        if self.state.swap(UNLOCKED, Ordering::Release) == CONTENDED {
            futex_wake(&self.state);
        }
    }

    /// For `pthread_atfork(prepare)`: take the lock and keep it past the guard's scope.
    pub fn acquire_for_fork(&self) {
        std::mem::forget(self.lock());
    }

    /// For the parent after fork: release what `acquire_for_fork` took.
    pub fn release_after_fork(&self) {
        self.unlock();
    }

    /// For the child after fork: this thread is the only one left, whatever it held is free.
    pub fn reset_in_child(&self) {
        self.state.store(UNLOCKED, Ordering::Release);
    }
}

impl<T> std::ops::Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> std::ops::DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        self.lock.unlock();
    }
}

fn futex_wait(word: &AtomicU32, expected: u32) {
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn counts_exactly_under_contention() {
        let lock = Arc::new(Lock::new(0u64));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        *lock.lock() += 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), 160_000);
    }

    #[test]
    fn fork_protocol_round_trip() {
        let lock = Lock::new(5);
        lock.acquire_for_fork();
        lock.release_after_fork();
        assert_eq!(*lock.lock(), 5);
        lock.acquire_for_fork();
        lock.reset_in_child();
        *lock.lock() += 1;
        assert_eq!(*lock.lock(), 6);
    }
}
