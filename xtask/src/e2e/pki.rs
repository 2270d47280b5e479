//! The node's CA, serving and client certificates, service-account key pair and kubeconfigs,
//! made with openssl. Client certificates rather than a token file: the apiserver needs no
//! `--token-auth-file`, and each component gets the identity RBAC's defaults expect.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::cmd::Cmd;

/// The kubeconfig users: file stem, certificate subject.
pub const CLIENTS: &[(&str, &str)] = &[
    ("admin", "/O=system:masters/CN=sidestep-e2e-admin"),
    ("controller-manager", "/CN=system:kube-controller-manager"),
    ("scheduler", "/CN=system:kube-scheduler"),
    // The apiserver's identity towards kubelet (logs, exec).
    (
        "apiserver-kubelet-client",
        "/O=system:masters/CN=kube-apiserver-kubelet-client",
    ),
];

pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn kubeconfig(&self, user: &str) -> PathBuf {
        self.dir.join(format!("{user}.kubeconfig"))
    }
}

/// Everything in `<dir>/pki`. `node` is kubelet's node name, which its client certificate and
/// its serving certificate must carry.
pub fn create(dir: &Path, node: &str, api_port: u16, service_ip: &str) -> Result<Pki> {
    let pki = Pki {
        dir: dir.join("pki"),
    };
    fs::create_dir_all(&pki.dir)?;
    let p = |name: &str| pki.file(name);

    openssl(
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
        ],
        &p("ca.key"),
    )?;
    Cmd::new("openssl")
        .args([
            "req",
            "-x509",
            "-new",
            "-sha256",
            "-days",
            "2",
            "-subj",
            "/CN=sidestep-e2e-ca",
        ])
        .arg("-key")
        .arg(p("ca.key"))
        .arg("-out")
        .arg(p("ca.crt"))
        .read()?;

    let apiserver_sans = format!(
        "IP:127.0.0.1,IP:{service_ip},DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,\
         DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    );
    sign(
        &pki,
        "apiserver",
        "/CN=kube-apiserver",
        "serverAuth",
        Some(&apiserver_sans),
    )?;
    sign(
        &pki,
        "kubelet-serving",
        &format!("/O=system:nodes/CN=system:node:{node}"),
        "serverAuth",
        Some(&format!("IP:127.0.0.1,DNS:localhost,DNS:{node}")),
    )?;
    sign(
        &pki,
        "kubelet",
        &format!("/O=system:nodes/CN=system:node:{node}"),
        "clientAuth",
        None,
    )?;
    for (user, subject) in CLIENTS {
        sign(&pki, user, subject, "clientAuth", None)?;
    }

    // The service-account token signing pair: the apiserver signs and verifies, kcm signs the
    // tokens of its controllers' accounts.
    Cmd::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
        ])
        .arg(p("sa.key"))
        .read()?;
    Cmd::new("openssl")
        .args(["pkey", "-pubout", "-in"])
        .arg(p("sa.key"))
        .arg("-out")
        .arg(p("sa.pub"))
        .read()?;

    let server = format!("https://127.0.0.1:{api_port}");
    for user in CLIENTS.iter().map(|(u, _)| *u).chain(["kubelet"]) {
        write_kubeconfig(&pki, user, &server)?;
    }
    Ok(pki)
}

fn openssl(args: &[&str], out: &Path) -> Result<()> {
    Cmd::new("openssl").args(args).arg(out).read()?;
    Ok(())
}

/// An EC key and a certificate signed by the CA, valid for two days: the node is for a run,
/// not for keeping.
fn sign(pki: &Pki, name: &str, subject: &str, usage: &str, sans: Option<&str>) -> Result<()> {
    let key = pki.file(&format!("{name}.key"));
    let csr = pki.file(&format!("{name}.csr"));
    let ext = pki.file(&format!("{name}.ext"));
    openssl(
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
        ],
        &key,
    )?;
    Cmd::new("openssl")
        .args(["req", "-new", "-sha256", "-subj", subject, "-key"])
        .arg(&key)
        .arg("-out")
        .arg(&csr)
        .read()?;
    let mut extensions = format!(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n"
    );
    if let Some(sans) = sans {
        extensions.push_str(&format!("subjectAltName={sans}\n"));
    }
    fs::write(&ext, extensions)?;
    Cmd::new("openssl")
        .args(["x509", "-req", "-sha256", "-days", "2", "-in"])
        .arg(&csr)
        .arg("-CA")
        .arg(pki.file("ca.crt"))
        .arg("-CAkey")
        .arg(pki.file("ca.key"))
        .arg("-CAcreateserial")
        .arg("-extfile")
        .arg(&ext)
        .arg("-out")
        .arg(pki.file(&format!("{name}.crt")))
        .read()?;
    fs::remove_file(csr)?;
    fs::remove_file(ext)?;
    Ok(())
}

/// A kubeconfig that names the certificate files rather than embedding them.
fn write_kubeconfig(pki: &Pki, user: &str, server: &str) -> Result<()> {
    let ca = pki.file("ca.crt");
    let crt = pki.file(&format!("{user}.crt"));
    let key = pki.file(&format!("{user}.key"));
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: sidestep-e2e\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: {user}\n  user:\n    client-certificate: {crt}\n    client-key: {key}\ncontexts:\n- name: sidestep-e2e\n  context:\n    cluster: sidestep-e2e\n    user: {user}\ncurrent-context: sidestep-e2e\n",
        ca = ca.display(),
        crt = crt.display(),
        key = key.display(),
    );
    fs::write(pki.kubeconfig(user), text)?;
    Ok(())
}
