//! Pure timing: lease timers (T1/T2), retransmission backoff with bounded jitter, the
//! renew/rebind/expire schedule, and a small seeded random source (no clock, no I/O here).

use std::time::Duration;

use super::mac::splitmix64;

/// Lease time, renewal time (T1) and rebinding time (T2), all measured from when the lease was
/// obtained. Always `t1 <= t2 <= lease`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timers {
    pub lease: Duration,
    pub t1: Duration,
    pub t2: Duration,
}

impl Timers {
    /// From an ACK's options 51 (lease), 58 (T1) and 59 (T2), in seconds. Without option 51 the
    /// lease is `default_lease`. T2 defaults to 7/8 and T1 to 1/2 of the lease (RFC 2131 §4.4.5);
    /// a server value that breaks `0 < T1 <= T2 <= lease` is replaced by its default.
    pub fn from_options(
        lease: Option<u32>,
        t1: Option<u32>,
        t2: Option<u32>,
        default_lease: Duration,
    ) -> Timers {
        let lease = lease
            .map(|s| Duration::from_secs(u64::from(s)))
            .unwrap_or(default_lease);
        let t2 = match t2.map(|s| Duration::from_secs(u64::from(s))) {
            Some(v) if !v.is_zero() && v <= lease => v,
            _ => lease / 8 * 7,
        };
        let t1 = match t1.map(|s| Duration::from_secs(u64::from(s))) {
            Some(v) if !v.is_zero() && v <= t2 => v,
            _ => (lease / 2).min(t2),
        };
        Timers { lease, t1, t2 }
    }
}

/// Exponential backoff: `initial`, doubling per attempt up to `max`, each value moved by a
/// uniformly random amount within ±`jitter_percent` % (capped at 50 %).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub jitter_percent: u8,
}

impl Backoff {
    pub const fn new(initial: Duration, max: Duration, jitter_percent: u8) -> Backoff {
        Backoff {
            initial,
            max,
            jitter_percent,
        }
    }

    /// The un-jittered delay before retry `attempt` (0-based): `min(initial * 2^attempt, max)`.
    pub fn base(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.initial
            .checked_mul(factor)
            .unwrap_or(self.max)
            .min(self.max.max(self.initial))
    }

    /// The jittered delay before retry `attempt`, from a random number: always within
    /// `base * (1 ± jitter)`.
    pub fn delay(&self, attempt: u32, random: u64) -> Duration {
        let base = self.base(attempt).as_nanos();
        let span = base * u128::from(self.jitter_percent.min(50)) / 100;
        if span == 0 {
            return Duration::from_nanos(u64::try_from(base).unwrap_or(u64::MAX));
        }
        let nanos = base - span + u128::from(random) % (2 * span + 1);
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// The most that `attempts` consecutive delays can add up to.
    pub fn upper_bound(&self, attempts: u32) -> Duration {
        (0..attempts)
            .map(|a| {
                let base = self.base(a);
                base + base * u32::from(self.jitter_percent.min(50)) / 100
            })
            .sum()
    }
}

/// What a lease keeper does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Nothing to do for this long; then ask again.
    Sleep(Duration),
    /// Past T1: send a renewal.
    Renew,
    /// Past T2: send a renewal (rebinding; any server may answer).
    Rebind,
    /// Past the lease time: the address is lost.
    Expired,
}

/// The renewal schedule. `elapsed` is the time since the lease was obtained; `last_failure` when
/// (also since obtained) the last renewal attempt for this lease failed, if one did. After a
/// failure the next attempt waits half the time left to the end of the phase (T2 for renewing,
/// the lease end for rebinding), at least `min_retry`, and never past the phase's end (RFC 2131
/// §4.4.5).
pub fn next_step(
    t: &Timers,
    elapsed: Duration,
    last_failure: Option<Duration>,
    min_retry: Duration,
) -> Next {
    if elapsed >= t.lease {
        return Next::Expired;
    }
    let (now, phase_start, phase_end) = if elapsed >= t.t2 {
        (Next::Rebind, t.t2, t.lease)
    } else if elapsed >= t.t1 {
        (Next::Renew, t.t1, t.t2)
    } else {
        return Next::Sleep(t.t1 - elapsed);
    };
    match last_failure {
        Some(failed) if failed >= phase_start && failed <= elapsed => {
            let wait = ((phase_end.saturating_sub(failed)) / 2).max(min_retry);
            let retry_at = (failed + wait).min(phase_end);
            if elapsed >= retry_at {
                now
            } else {
                Next::Sleep(retry_at - elapsed)
            }
        }
        _ => now,
    }
}

/// A small deterministic random source (splitmix64). Seeded from [`random_seed`] in the driver and
/// from a constant in tests.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        splitmix64(self.0)
    }

    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
}

/// A seed that differs per call and per process: std's per-process random hash keys, the wall
/// clock and a counter. Good enough for transaction ids and jitter (not for secrets).
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn t1_t2_default_to_half_and_seven_eighths() {
        let t = Timers::from_options(Some(3600), None, None, secs(1));
        assert_eq!((t.lease, t.t1, t.t2), (secs(3600), secs(1800), secs(3150)));
        let t = Timers::from_options(Some(120), None, None, secs(1));
        assert_eq!((t.t1, t.t2), (secs(60), secs(105)));
    }

    #[test]
    fn t1_t2_from_the_server_when_sane() {
        let t = Timers::from_options(Some(600), Some(100), Some(200), secs(1));
        assert_eq!((t.lease, t.t1, t.t2), (secs(600), secs(100), secs(200)));
    }

    #[test]
    fn insane_t1_t2_fall_back_to_defaults() {
        // T2 beyond the lease, T1 beyond T2, zeros.
        let t = Timers::from_options(Some(800), Some(900), Some(1000), secs(1));
        assert_eq!((t.t1, t.t2), (secs(400), secs(700)));
        let t = Timers::from_options(Some(800), Some(0), Some(0), secs(1));
        assert_eq!((t.t1, t.t2), (secs(400), secs(700)));
        // A valid T2 shorter than lease/2 pulls the default T1 down to it.
        let t = Timers::from_options(Some(800), None, Some(100), secs(1));
        assert_eq!((t.t1, t.t2), (secs(100), secs(100)));
    }

    #[test]
    fn missing_lease_time_uses_the_default_and_infinite_does_not_overflow() {
        let t = Timers::from_options(None, None, None, secs(3600));
        assert_eq!(t.lease, secs(3600));
        let t = Timers::from_options(Some(u32::MAX), None, None, secs(1));
        assert!(t.t1 < t.t2 && t.t2 < t.lease);
    }

    #[test]
    fn backoff_doubles_to_the_cap() {
        let b = Backoff::new(secs(2), secs(8), 0);
        let d: Vec<_> = (0..6).map(|a| b.delay(a, 12345)).collect();
        assert_eq!(d, [secs(2), secs(4), secs(8), secs(8), secs(8), secs(8)]);
        assert_eq!(b.base(200), secs(8));
        assert_eq!(b.upper_bound(4), secs(22));
    }

    #[test]
    fn jitter_stays_within_its_bound_and_varies() {
        let b = Backoff::new(Duration::from_millis(1000), secs(4), 10);
        let mut rng = Rng::new(7);
        let mut seen = std::collections::HashSet::new();
        for attempt in 0..8 {
            let base = b.base(attempt);
            for _ in 0..1000 {
                let d = b.delay(attempt, rng.next_u64());
                assert!(
                    d >= base * 9 / 10 && d <= base * 11 / 10,
                    "{d:?} vs {base:?}"
                );
                seen.insert(d);
            }
        }
        assert!(seen.len() > 100, "jitter should vary");
        let total: Duration = (0..5).map(|a| b.base(a) * 11 / 10).sum();
        assert_eq!(b.upper_bound(5), total);
    }

    #[test]
    fn jitter_is_capped_at_fifty_percent() {
        let b = Backoff::new(secs(1), secs(1), 255);
        for r in [0, 1, u64::MAX / 2, u64::MAX] {
            let d = b.delay(0, r);
            assert!(d >= Duration::from_millis(500) && d <= Duration::from_millis(1500));
        }
    }

    #[test]
    fn schedule_renews_at_t1_rebinds_at_t2_and_expires() {
        let t = Timers::from_options(Some(1000), None, None, secs(1));
        let min = secs(10);
        assert_eq!(next_step(&t, secs(0), None, min), Next::Sleep(secs(500)));
        assert_eq!(next_step(&t, secs(499), None, min), Next::Sleep(secs(1)));
        assert_eq!(next_step(&t, secs(500), None, min), Next::Renew);
        assert_eq!(next_step(&t, secs(875), None, min), Next::Rebind);
        assert_eq!(next_step(&t, secs(1000), None, min), Next::Expired);
    }

    #[test]
    fn schedule_after_failures_halves_the_remaining_time_with_a_floor() {
        let t = Timers::from_options(Some(1000), None, None, secs(1));
        let min = secs(10);
        // Renew failed at 500: T2 is 875, half of 375 is 187.5 -> retry at 687.5.
        assert_eq!(
            next_step(&t, secs(500), Some(secs(500)), min),
            Next::Sleep(Duration::from_millis(187_500))
        );
        assert_eq!(
            next_step(&t, Duration::from_millis(687_500), Some(secs(500)), min),
            Next::Renew
        );
        // Close to T2 the floor applies, but never past T2: rebinding starts there.
        assert_eq!(
            next_step(&t, secs(870), Some(secs(870)), min),
            Next::Sleep(secs(5))
        );
        // A renew failure does not delay the first rebind.
        assert_eq!(next_step(&t, secs(875), Some(secs(870)), min), Next::Rebind);
        // Rebinding failed at 875: half of 125 -> 937.5.
        assert_eq!(
            next_step(&t, secs(875), Some(secs(875)), min),
            Next::Sleep(Duration::from_millis(62_500))
        );
        // Near the end the floor is cut at the lease end, then the lease expires.
        assert_eq!(
            next_step(&t, secs(995), Some(secs(995)), min),
            Next::Sleep(secs(5))
        );
        assert_eq!(
            next_step(&t, secs(1000), Some(secs(995)), min),
            Next::Expired
        );
    }

    #[test]
    fn rng_is_deterministic_per_seed() {
        let a: Vec<_> = {
            let mut r = Rng::new(1);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let b: Vec<_> = {
            let mut r = Rng::new(1);
            (0..4).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(random_seed(), random_seed());
    }
}
