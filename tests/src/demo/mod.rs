//! The steps of `testbed demo`, one module per component.

pub mod ccm;
pub mod csi;
pub mod lb;
