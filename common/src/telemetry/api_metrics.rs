//! A tower layer under the kube client that counts Kubernetes API requests by verb, resource and
//! HTTP code (the "API requests per Service" figure of the benchmarks comes from it).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Method, Request, Response};
use tower::{Layer, Service};

use super::metrics::{ApiLabels, Metrics};

#[derive(Clone)]
pub struct ApiMetricsLayer {
    metrics: Metrics,
}

impl ApiMetricsLayer {
    pub fn new(metrics: Metrics) -> Self {
        ApiMetricsLayer { metrics }
    }
}

impl<S> Layer<S> for ApiMetricsLayer {
    type Service = ApiMetricsService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        ApiMetricsService {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct ApiMetricsService<S> {
    inner: S,
    metrics: Metrics,
}

impl<S, B, RB> Service<Request<B>> for ApiMetricsService<S>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Future: Send + 'static,
    S::Error: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (verb, resource) = classify(req.method(), req.uri().path(), req.uri().query());
        let metrics = self.metrics.clone();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await;
            let code = match &res {
                Ok(r) => r.status().as_u16().to_string(),
                Err(_) => "error".to_string(),
            };
            metrics
                .api_requests
                .get_or_create(&ApiLabels {
                    verb: verb.to_string(),
                    resource,
                    code,
                })
                .inc();
            res
        })
    }
}

/// `(verb, resource[/subresource])` of an API request path, as kube-apiserver's audit names them.
pub fn classify(method: &Method, path: &str, query: Option<&str>) -> (&'static str, String) {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    // /api/v1/... or /apis/<group>/<version>/...
    let rest: &[&str] = match parts.as_slice() {
        ["api", _v, rest @ ..] => rest,
        ["apis", _g, _v, rest @ ..] => rest,
        _ => &[],
    };
    let rest = match rest {
        ["namespaces", _ns, more @ ..] if !more.is_empty() => more,
        other => other,
    };
    let (resource, named) = match rest {
        [] => (path.to_string(), false),
        [r] => (r.to_string(), false),
        [r, _name] => (r.to_string(), true),
        [r, _name, sub, ..] => (format!("{r}/{sub}"), true),
    };
    let watch = query.is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
    let verb = match *method {
        Method::GET if watch => "watch",
        Method::GET if named => "get",
        Method::GET => "list",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE if named => "delete",
        Method::DELETE => "deletecollection",
        _ => "other",
    };
    (verb, resource)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_requests_like_the_audit_log() {
        for (m, path, q, verb, res) in [
            (
                Method::GET,
                "/api/v1/namespaces/default/services/web",
                None,
                "get",
                "services",
            ),
            (
                Method::GET,
                "/api/v1/services",
                Some("watch=true&resourceVersion=1"),
                "watch",
                "services",
            ),
            (Method::GET, "/api/v1/nodes", None, "list", "nodes"),
            (
                Method::PATCH,
                "/api/v1/namespaces/a/services/web/status",
                None,
                "patch",
                "services/status",
            ),
            (
                Method::POST,
                "/apis/loadbalancer.harvesterhci.io/v1beta1/namespaces/vms/loadbalancers",
                None,
                "create",
                "loadbalancers",
            ),
            (
                Method::PUT,
                "/apis/subresources.kubevirt.io/v1/namespaces/vms/virtualmachines/w1/addvolume",
                None,
                "update",
                "virtualmachines/addvolume",
            ),
            (
                Method::DELETE,
                "/api/v1/namespaces/a/persistentvolumeclaims/p",
                None,
                "delete",
                "persistentvolumeclaims",
            ),
            (
                Method::GET,
                "/api/v1/namespaces/kube-system",
                None,
                "get",
                "namespaces",
            ),
        ] {
            assert_eq!(classify(&m, path, q), (verb, res.to_string()), "{m} {path}");
        }
    }
}
