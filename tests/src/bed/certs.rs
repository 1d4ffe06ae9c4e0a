//! Certificates for the test bed: one CA signs the API servers' serving certs, the admin client
//! certs and the stand-in virt-api's serving cert; a front-proxy CA signs the aggregator's client;
//! a third CA signs the serving cert of Harvester's LoadBalancer webhook stand-in.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

pub use rcgen::ExtendedKeyUsagePurpose as KeyUsage;

use crate::BedError;

/// A PEM certificate and key written to disk.
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub cert_pem: String,
    pub key_pem: String,
}

/// Everything the bed needs, written under `dir`.
pub struct Pki {
    pub ca: CertFiles,
    pub front_proxy_ca: CertFiles,
    pub front_proxy_client: CertFiles,
    /// Serving cert for both kube-apiservers (127.0.0.1, localhost, 10.0.2.2: the host's
    /// loopback as a guest VM on QEMU's user network reaches it, and the addresses Pods of the
    /// real guest node dial: the `kubernetes` Service VIP and the Pod bridge's gateway).
    pub apiserver: CertFiles,
    /// Client cert of user `admin` in group `system:masters`.
    pub admin: CertFiles,
    /// Serving cert of the stand-in virt-api; the aggregator dials it as `virt-api.kubevirt.svc`.
    pub virt_api: CertFiles,
    /// CA of Harvester's LoadBalancer webhook (the `caBundle` of its MutatingWebhookConfiguration);
    /// its own, as upstream's webhook server makes its own CA.
    pub lb_webhook_ca: CertFiles,
    /// Serving cert of the LoadBalancer webhook stand-in, dialled at `https://127.0.0.1:<port>`.
    pub lb_webhook: CertFiles,
    /// Service-account token signing key pair.
    pub sa_key: PathBuf,
    pub sa_pub: PathBuf,
}

struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    files: CertFiles,
}

fn err(what: &str, e: impl std::fmt::Display) -> BedError {
    BedError::Setup(format!("generating {what}: {e}"))
}

fn write(dir: &Path, name: &str, cert_pem: String, key_pem: String) -> Result<CertFiles, BedError> {
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    std::fs::write(&cert, &cert_pem).map_err(|e| err(name, e))?;
    std::fs::write(&key, &key_pem).map_err(|e| err(name, e))?;
    Ok(CertFiles {
        cert,
        key,
        cert_pem,
        key_pem,
    })
}

fn new_ca(dir: &Path, name: &str) -> Result<Ca, BedError> {
    let key = KeyPair::generate().map_err(|e| err(name, e))?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(|e| err(name, e))?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key_pem = key.serialize_pem();
    let issuer = CertifiedIssuer::self_signed(params, key).map_err(|e| err(name, e))?;
    let files = write(dir, name, issuer.pem(), key_pem)?;
    Ok(Ca { issuer, files })
}

fn leaf(
    dir: &Path,
    ca: &Ca,
    name: &str,
    common_name: &str,
    orgs: &[&str],
    sans: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> Result<CertFiles, BedError> {
    let key = KeyPair::generate().map_err(|e| err(name, e))?;
    let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
    let mut params = CertificateParams::new(sans).map_err(|e| err(name, e))?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    for org in orgs {
        params
            .distinguished_name
            .push(DnType::OrganizationName, *org);
    }
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![usage];
    let cert = params
        .signed_by(&key, &ca.issuer)
        .map_err(|e| err(name, e))?;
    write(dir, name, cert.pem(), key.serialize_pem())
}

impl Pki {
    pub fn generate(dir: &Path) -> Result<Pki, BedError> {
        use ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        let ca = new_ca(dir, "ca")?;
        let fp_ca = new_ca(dir, "front-proxy-ca")?;
        let apiserver = leaf(
            dir,
            &ca,
            "apiserver",
            "kube-apiserver",
            &[],
            &[
                "127.0.0.1",
                "localhost",
                "kubernetes.default.svc",
                crate::real::vm::HOST_FROM_GUEST,
                crate::real::podnet::KUBERNETES_VIP,
                crate::real::podnet::GATEWAY,
            ],
            ServerAuth,
        )?;
        let admin = leaf(
            dir,
            &ca,
            "admin",
            "admin",
            &["system:masters"],
            &[],
            ClientAuth,
        )?;
        let virt_api = leaf(
            dir,
            &ca,
            "virt-api",
            "virt-api",
            &[],
            &["virt-api.kubevirt.svc", "localhost", "127.0.0.1"],
            ServerAuth,
        )?;
        let wh_ca = new_ca(dir, "lb-webhook-ca")?;
        let lb_webhook = leaf(
            dir,
            &wh_ca,
            "lb-webhook",
            "harvester-load-balancer-webhook",
            &[],
            &["127.0.0.1", "localhost"],
            ServerAuth,
        )?;
        let front_proxy_client = leaf(
            dir,
            &fp_ca,
            "front-proxy-client",
            "front-proxy-client",
            &[],
            &[],
            ClientAuth,
        )?;
        let sa = KeyPair::generate().map_err(|e| err("service-account key", e))?;
        let sa_key = dir.join("sa.key");
        let sa_pub = dir.join("sa.pub");
        std::fs::write(&sa_key, sa.serialize_pem()).map_err(|e| err("sa.key", e))?;
        std::fs::write(&sa_pub, sa.public_key_pem()).map_err(|e| err("sa.pub", e))?;
        Ok(Pki {
            ca: ca.files,
            front_proxy_ca: fp_ca.files,
            front_proxy_client,
            apiserver,
            admin,
            virt_api,
            lb_webhook_ca: wh_ca.files,
            lb_webhook,
            sa_key,
            sa_pub,
        })
    }

    /// A client certificate for `user` in `groups`, signed by the cluster CA (for RBAC tests).
    pub fn client_cert(
        &self,
        dir: &Path,
        user: &str,
        groups: &[&str],
    ) -> Result<CertFiles, BedError> {
        let name = format!("user-{user}");
        self.leaf(
            dir,
            &name,
            user,
            groups,
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    /// A leaf certificate `<dir>/<name>.{crt,key}` signed by the cluster CA: `common_name` in
    /// `orgs`, with `sans` and `usage` (a serving certificate of a component the bed runs).
    pub fn leaf(
        &self,
        dir: &Path,
        name: &str,
        common_name: &str,
        orgs: &[&str],
        sans: &[&str],
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<CertFiles, BedError> {
        let key = KeyPair::from_pem(&self.ca.key_pem).map_err(|e| err("ca key", e))?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(|e| err("ca", e))?;
        params.distinguished_name.push(DnType::CommonName, "ca");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // Re-derive the issuer from the CA's own parameters and key: same name and key id.
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = Ca {
            issuer: CertifiedIssuer::self_signed(params, key).map_err(|e| err("ca", e))?,
            files: self.ca.clone(),
        };
        leaf(dir, &ca, name, common_name, orgs, sans, usage)
    }
}
