//! Tools every other layer uses: child processes and the strays a component leaves, bounded
//! waits, the Go tools' cache, helm, watches that time when objects reach a state, and scraping
//! HTTP endpoints. Rule: nothing here imports another layer of the crate (only the root's
//! `BedError`).

pub mod helm;
pub mod leftovers;
pub mod observe;
pub mod process;
pub mod scrape;
pub mod tools;
pub mod wait;
