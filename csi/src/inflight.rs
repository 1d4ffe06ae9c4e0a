//! One operation per volume at a time: a second concurrent call for the same volume gets
//! `ABORTED` (the CSI spec's "operation pending for volume"), and the CO retries.

use std::collections::HashSet;
use std::sync::Mutex;

#[derive(Default)]
pub struct InFlight(Mutex<HashSet<String>>);

pub struct Guard<'a> {
    set: &'a InFlight,
    key: String,
}

impl InFlight {
    /// Marks `key` busy until the guard drops; `None` if it already is.
    pub fn begin(&self, key: &str) -> Option<Guard<'_>> {
        let mut set = self.0.lock().unwrap_or_else(|p| p.into_inner());
        set.insert(key.to_string()).then(|| Guard {
            set: self,
            key: key.to_string(),
        })
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        let mut set = self.set.0.lock().unwrap_or_else(|p| p.into_inner());
        set.remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_busy_until_its_guard_drops() {
        let f = InFlight::default();
        let g = f.begin("v1").expect("free");
        assert!(f.begin("v1").is_none());
        assert!(f.begin("v2").is_some());
        drop(g);
        assert!(f.begin("v1").is_some());
    }
}
