//! helm against one of the bed's API servers, with its cache, config and data in the bed's
//! directory (nothing written to the user's home).

use std::path::PathBuf;
use std::process::Command;

/// helm with `kubeconfig`, its homes under `home`.
#[derive(Clone, Debug)]
pub struct Helm {
    pub kubeconfig: PathBuf,
    pub home: PathBuf,
}

impl Helm {
    /// Runs helm with `args`; Ok(stdout) or Err(the command and helm's output).
    pub fn run(&self, args: &[&str]) -> Result<String, String> {
        let helm = crate::util::tools::tool("helm").map_err(|e| e.to_string())?;
        let out = Command::new(helm)
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("HELM_CACHE_HOME", self.home.join("cache"))
            .env("HELM_CONFIG_HOME", self.home.join("config"))
            .env("HELM_DATA_HOME", self.home.join("data"))
            .output()
            .map_err(|e| format!("running helm: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "helm {}:\n{}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }
}
