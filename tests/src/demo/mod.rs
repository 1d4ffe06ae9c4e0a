//! The steps of `testbed demo`, one module per component.

pub mod ccm;
pub mod csi;
pub mod lb;

use harvester_cloud_provider::Config;
use testbed::TestBed;

/// The cloud provider's configuration for the demo bed, plus `extra` flags.
pub fn ccm_config(bed: &TestBed, extra: &[&str]) -> anyhow::Result<Config> {
    let mut args = vec![
        "harvester-cloud-provider".to_string(),
        "--cloud-config".into(),
        bed.cloud_config.to_string_lossy().into_owned(),
        "--kubeconfig".into(),
        bed.guest.kubeconfig.to_string_lossy().into_owned(),
        "--cluster-name".into(),
        "demo".into(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    Ok(Config::from_args(args)?)
}
