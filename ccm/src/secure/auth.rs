//! Who may read the endpoints, decided by the guest cluster's API server as upstream's delegated
//! authentication and authorization do (k8s.io/apiserver v0.34 pkg/server/options
//! authentication.go and authorization.go, `NewDelegatingAuthenticationOptions` /
//! `NewDelegatingAuthorizationOptions`; the chain is k8s.io/controller-manager app/serve.go
//! `BuildHandlerChain`):
//! - no `Authorization` header: the anonymous user (`system:anonymous`, group
//!   `system:unauthenticated`);
//! - a bearer token: a TokenReview (authentication.k8s.io/v1); a token the API server does not
//!   accept, or a review that fails, is 401;
//! - then the path: `--authorization-always-allow-paths` (a trailing `*` matches a prefix) and
//!   group `system:masters` pass; anything else is a SubjectAccessReview (authorization.k8s.io/v1)
//!   for the non-resource path with the lower-cased HTTP method as verb: denied is 403, a review
//!   that fails is 500.
//!
//! Both reviews are cached per input for the TTLs of the `--authentication-token-webhook-cache-ttl`,
//! `--authorization-webhook-cache-authorized-ttl` and `--authorization-webhook-cache-unauthorized-ttl`
//! flags (upstream: 10 s each); reviews that fail (no answer) are not cached.
//!
//! Tokens are cached as upstream's `cachedTokenAuthenticator` caches them (k8s.io/apiserver v0.34
//! pkg/authentication/token/cache/cached_token_authenticator.go, made by
//! pkg/authentication/authenticatorfactory/delegating.go as `cache.New(tokenAuth, false,
//! CacheTTL, CacheTTL)`): accepted and rejected tokens alike for the TTL (its success and
//! failure TTLs), keyed by an HMAC-SHA256 of the token under a key drawn at start (`keyFunc`),
//! so no token is kept in memory. Accepted and rejected tokens have a cache each, so rejected
//! ones cannot crowd out the scrapers'.
//!
//! The bound on TokenReviews, which upstream does not have: a token in neither cache is reviewed
//! only while the review budget allows, a bucket of [`REVIEW_BURST`] refilled at
//! [`REVIEWS_PER_SECOND`]; over it the request is 429 (`Retry-After: 1`, as upstream's
//! max-in-flight filter answers) without a review. So tokens never accepted cost at most
//! `REVIEW_BURST + REVIEWS_PER_SECOND × t` TokenReviews in any `t` seconds, however many
//! distinct ones arrive, and one per distinct token per TTL once the answer is cached. A token
//! accepted before is reviewed again when its answer expires without asking the budget (once
//! per TTL each, as many as the accepted cache holds), so a flood of bogus tokens does not keep
//! a working scraper out; a token seen for the first time during such a flood competes with it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};

/// Upstream's `--authorization-always-allow-paths` default (authorization.go).
pub const DEFAULT_ALWAYS_ALLOW_PATHS: &[&str] = &["/healthz", "/readyz", "/livez"];
/// Upstream's `AlwaysAllowGroups` default: kube-apiserver lets this group do anything anyway.
const ALWAYS_ALLOW_GROUP: &str = "system:masters";
/// At most this many answers per cache: when full, expired ones are swept, and a new answer is
/// not kept while it stays full (so a flood of distinct tokens cannot grow memory).
const CACHE_CAPACITY: usize = 4096;
/// Upstream's timeout of a review (`TokenRequestTimeout`, `ClientTimeout`: 10 s).
const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);
/// TokenReviews of uncached tokens at once (the review budget's bucket size).
pub const REVIEW_BURST: u32 = 10;
/// TokenReviews of uncached tokens per second once the burst is spent. A scraper's token is
/// reviewed once per cache TTL, so a few scrapers and the odd `curl` need far less.
pub const REVIEWS_PER_SECOND: f64 = 5.0;

/// The typed flags of delegated authentication and authorization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthOptions {
    pub always_allow_paths: Vec<String>,
    pub token_cache_ttl: Duration,
    pub allowed_cache_ttl: Duration,
    pub denied_cache_ttl: Duration,
}

impl Default for AuthOptions {
    fn default() -> Self {
        AuthOptions {
            always_allow_paths: DEFAULT_ALWAYS_ALLOW_PATHS
                .iter()
                .map(|p| p.to_string())
                .collect(),
            token_cache_ttl: Duration::from_secs(10),
            allowed_cache_ttl: Duration::from_secs(10),
            denied_cache_ttl: Duration::from_secs(10),
        }
    }
}

/// The requester, as the TokenReview returned it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct User {
    pub name: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

impl User {
    fn anonymous() -> User {
        User {
            name: "system:anonymous".into(),
            groups: vec!["system:unauthenticated".into()],
            ..User::default()
        }
    }
}

/// What the request gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allow,
    /// 401: a token was given and not accepted.
    Unauthorized,
    /// 403, with upstream's message.
    Forbidden(String),
    /// 429: a token to review while the review budget is spent.
    TooManyRequests,
    /// 500: a review could not be made.
    Error(String),
}

/// Answers with the instant each stops being valid.
type Cache<K, V> = Mutex<HashMap<K, (Instant, V)>>;

/// Delegated authentication and authorization against one API server.
pub struct Delegated {
    /// Asked the TokenReviews.
    authn: kube::Client,
    /// Asked the SubjectAccessReviews.
    authz: kube::Client,
    opts: AuthOptions,
    /// HMAC key of the token caches' keys.
    key: ring::hmac::Key,
    /// Accepted tokens.
    tokens: Cache<TokenKey, User>,
    /// Rejected tokens.
    rejected: Cache<TokenKey, ()>,
    reviews: Mutex<Budget>,
    decisions: Cache<(User, String, String), bool>,
}

/// HMAC-SHA256 of a token.
type TokenKey = [u8; 32];

impl Delegated {
    /// Reviews tokens with `authn` and requests with `authz` (upstream's
    /// `--authentication-kubeconfig` and `--authorization-kubeconfig`; often one client).
    pub fn new(authn: kube::Client, authz: kube::Client, opts: AuthOptions) -> Arc<Delegated> {
        let key =
            ring::hmac::Key::generate(ring::hmac::HMAC_SHA256, &ring::rand::SystemRandom::new())
                .expect("the system's random source");
        Arc::new(Delegated {
            authn,
            authz,
            opts,
            key,
            tokens: Mutex::default(),
            rejected: Mutex::default(),
            reviews: Mutex::new(Budget::full(Instant::now())),
            decisions: Mutex::default(),
        })
    }

    /// The decision for a request with this `Authorization` header (if any), method and path.
    pub async fn decide(&self, authorization: Option<&[u8]>, method: &str, path: &str) -> Decision {
        let user = match authorization {
            None => User::anonymous(),
            Some(header) => {
                let Some(token) = bearer_token(header) else {
                    // Another scheme (Basic, ...): no authenticator here takes it, as upstream
                    // has none, so the request stays anonymous.
                    return self.authorize(User::anonymous(), method, path).await;
                };
                if token.is_empty() {
                    return Decision::Unauthorized;
                }
                match self.authenticate(token).await {
                    Ok(Some(user)) => user,
                    Ok(None) => return Decision::Unauthorized,
                    Err(ReviewError::OverBudget) => return Decision::TooManyRequests,
                    Err(e) => {
                        tracing::warn!("TokenReview failed: {e}");
                        return Decision::Unauthorized;
                    }
                }
            }
        };
        self.authorize(user, method, path).await
    }

    async fn authenticate(&self, token: &str) -> Result<Option<User>, ReviewError> {
        let key = token_key(&self.key, token);
        if let Some(user) = cached(&self.tokens, &key) {
            return Ok(Some(user));
        }
        if cached(&self.rejected, &key).is_some() {
            return Ok(None);
        }
        // A token accepted before (its answer expired, its entry not yet swept) is reviewed
        // again without the budget, so bogus tokens cannot keep a working scraper out.
        let known = self.tokens.lock().is_ok_and(|map| map.contains_key(&key));
        let allowed = known || self.spend_review();
        if !allowed {
            return Err(ReviewError::OverBudget);
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let api: Api<TokenReview> = Api::all(self.authn.clone());
        let status = within_timeout(api.create(&PostParams::default(), &review))
            .await?
            .status
            .unwrap_or_default();
        let user = if status.authenticated == Some(true) {
            let u = status.user.unwrap_or_default();
            Some(User {
                name: u.username.unwrap_or_default(),
                uid: u.uid.unwrap_or_default(),
                groups: u.groups.unwrap_or_default(),
                extra: u.extra.unwrap_or_default().into_iter().collect(),
            })
        } else {
            None
        };
        let ttl = self.opts.token_cache_ttl;
        match &user {
            Some(u) => remember(&self.tokens, key, u.clone(), ttl),
            None => {
                if let Ok(mut map) = self.tokens.lock() {
                    map.remove(&key);
                }
                remember(&self.rejected, key, (), ttl)
            }
        }
        Ok(user)
    }

    /// Takes one review from the budget, if there is one left.
    fn spend_review(&self) -> bool {
        let mut budget = self.reviews.lock().unwrap_or_else(|p| p.into_inner());
        budget.take(Instant::now(), REVIEW_BURST, REVIEWS_PER_SECOND)
    }

    async fn authorize(&self, user: User, method: &str, path: &str) -> Decision {
        if self.always_allowed(path) || user.groups.iter().any(|g| g == ALWAYS_ALLOW_GROUP) {
            return Decision::Allow;
        }
        // Upstream's RequestInfo: a non-resource request's verb is its lower-cased method.
        let verb = method.to_ascii_lowercase();
        let key = (user, verb, path.to_string());
        let allowed = match cached(&self.decisions, &key) {
            Some(a) => a,
            None => match self.review(&key.0, &key.1, &key.2).await {
                Ok(a) => {
                    let ttl = if a {
                        self.opts.allowed_cache_ttl
                    } else {
                        self.opts.denied_cache_ttl
                    };
                    remember(&self.decisions, key.clone(), a, ttl);
                    a
                }
                Err(e) => {
                    tracing::warn!("SubjectAccessReview failed: {e}");
                    return Decision::Error(format!("authorization review failed: {e}"));
                }
            },
        };
        if allowed {
            Decision::Allow
        } else {
            Decision::Forbidden(format!(
                "forbidden: User \"{}\" cannot {} path \"{}\"",
                key.0.name, key.1, key.2
            ))
        }
    }

    fn always_allowed(&self, path: &str) -> bool {
        path_allowed(&self.opts.always_allow_paths, path)
    }

    async fn review(&self, user: &User, verb: &str, path: &str) -> Result<bool, ReviewError> {
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.name.clone()),
                uid: Some(user.uid.clone()).filter(|u| !u.is_empty()),
                groups: Some(user.groups.clone()),
                extra: Some(user.extra.clone()).filter(|e| !e.is_empty()),
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(path.to_string()),
                    verb: Some(verb.to_string()),
                }),
                resource_attributes: None,
            },
            ..SubjectAccessReview::default()
        };
        let api: Api<SubjectAccessReview> = Api::all(self.authz.clone());
        let status = within_timeout(api.create(&PostParams::default(), &review))
            .await?
            .status;
        Ok(status.is_some_and(|s| s.allowed && s.denied != Some(true)))
    }
}

/// `call`, or a timeout error after [`REVIEW_TIMEOUT`].
async fn within_timeout<T>(
    call: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, ReviewError> {
    match tokio::time::timeout(REVIEW_TIMEOUT, call).await {
        Ok(r) => r.map_err(ReviewError::Api),
        Err(_) => Err(ReviewError::Timeout(REVIEW_TIMEOUT)),
    }
}

/// Why a review has no answer.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("{0}")]
    Api(kube::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("not sent: the review budget is spent")]
    OverBudget,
}

/// The cache key of `token`: upstream's `keyFunc` (HMAC-SHA256 under a random key, so the
/// cache holds no token and its keys cannot be precomputed).
fn token_key(key: &ring::hmac::Key, token: &str) -> TokenKey {
    let tag = ring::hmac::sign(key, token.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(tag.as_ref());
    out
}

/// A token bucket: up to `burst` at once, refilled at `per_second`.
#[derive(Debug, Clone, Copy)]
struct Budget {
    left: f64,
    at: Instant,
}

impl Budget {
    fn full(now: Instant) -> Budget {
        Budget {
            left: f64::from(REVIEW_BURST),
            at: now,
        }
    }

    /// Takes one at `now` if there is one.
    fn take(&mut self, now: Instant, burst: u32, per_second: f64) -> bool {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * per_second;
        self.left = (self.left + refill).min(f64::from(burst));
        self.at = now.max(self.at);
        if self.left >= 1.0 {
            self.left -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Whether `path` is among `patterns` (k8s.io/apiserver pkg/authorization/path: a leading `/`
/// is optional on both sides, a trailing `*` matches a prefix).
fn path_allowed(patterns: &[String], path: &str) -> bool {
    let path = path.strip_prefix('/').unwrap_or(path);
    patterns.iter().any(|p| {
        let p = p.strip_prefix('/').unwrap_or(p);
        match p.strip_suffix('*') {
            Some(prefix) => path.starts_with(prefix),
            None => p == path,
        }
    })
}

/// Checks one `--authorization-always-allow-paths` entry as upstream does: `*` only at the end.
pub fn check_allow_path(pattern: &str) -> Result<(), String> {
    let p = pattern.strip_prefix('/').unwrap_or(pattern);
    match p.char_indices().find(|&(i, c)| c == '*' && i + 1 < p.len()) {
        Some(_) => Err(format!("only trailing * allowed in {p:?}")),
        None => Ok(()),
    }
}

/// The token of an `Authorization: Bearer <token>` header (scheme case-insensitive, as
/// k8s.io/apiserver's bearertoken authenticator reads it). `Some("")` for an empty token, which
/// upstream refuses (401).
fn bearer_token(header: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(header).ok()?.trim();
    let (scheme, token) = value.split_once(' ').unwrap_or((value, ""));
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// The answer for `key`, unless it has expired.
fn cached<K, Q, V>(cache: &Cache<K, V>, key: &Q) -> Option<V>
where
    K: std::borrow::Borrow<Q> + Eq + std::hash::Hash,
    Q: Eq + std::hash::Hash + ?Sized,
    V: Clone,
{
    let map = cache.lock().ok()?;
    map.get(key)
        .filter(|(expires, _)| Instant::now() < *expires)
        .map(|(_, v)| v.clone())
}

fn remember<K: Eq + std::hash::Hash, V>(cache: &Cache<K, V>, key: K, value: V, ttl: Duration) {
    if ttl.is_zero() {
        return;
    }
    let Ok(mut map) = cache.lock() else {
        return;
    };
    let now = Instant::now();
    if map.len() >= CACHE_CAPACITY {
        map.retain(|_, (expires, _)| now < *expires);
        if map.len() >= CACHE_CAPACITY {
            return;
        }
    }
    map.insert(key, (now + ttl, value));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_are_read_as_upstream_reads_them() {
        assert_eq!(bearer_token(b"Bearer abc"), Some("abc"));
        assert_eq!(bearer_token(b"bearer  abc "), Some("abc"));
        assert_eq!(bearer_token(b"Bearer"), Some(""));
        assert_eq!(bearer_token(b"Basic dXNlcjpwdw=="), None);
        assert_eq!(bearer_token(&[0xff, 0xfe]), None);
    }

    #[test]
    fn caches_expire_and_stay_bounded() {
        let cache: Cache<String, bool> = Mutex::default();
        let ttl = Duration::from_secs(60);
        for i in 0..CACHE_CAPACITY {
            remember(&cache, format!("t{i}"), true, ttl);
        }
        remember(&cache, "one more".into(), true, ttl);
        assert_eq!(cached(&cache, "t0"), Some(true));
        assert_eq!(cached(&cache, "one more"), None, "full: not kept");
        let brief: Cache<String, bool> = Mutex::default();
        remember(&brief, "t0".into(), true, Duration::from_millis(1));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(cached(&brief, "t0"), None, "expired");
        remember(&cache, "zero ttl".into(), true, Duration::ZERO);
        assert_eq!(cache.lock().unwrap().len(), CACHE_CAPACITY);
    }

    #[test]
    fn the_review_budget_allows_a_burst_then_the_rate() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut b = Budget::full(t0);
        let taken = (0..100).filter(|_| b.take(t0, 10, 5.0)).count();
        assert_eq!(taken, 10, "the burst, then nothing at the same instant");
        assert!(!b.take(at(100), 10, 5.0), "half a review refilled");
        assert!(b.take(at(250), 10, 5.0), "one after 200 ms at 5/s");
        assert!(!b.take(at(300), 10, 5.0));
        // Over any span t: at most burst + rate × t.
        let mut b = Budget::full(t0);
        let taken = (0..=3010).filter(|ms| b.take(at(*ms), 10, 5.0)).count();
        assert_eq!(taken, 10 + 15);
        // A long pause refills the burst, not more.
        let taken = (0..100).filter(|_| b.take(at(60_000), 10, 5.0)).count();
        assert_eq!(taken, 10);
        // An instant before the last one (another thread's) refills nothing.
        assert!(!b.take(at(59_000), 10, 5.0));
    }

    #[test]
    fn rejected_tokens_are_cached_by_hash_bounded_and_expire() {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"k");
        let other = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"other");
        assert_eq!(token_key(&key, "t"), token_key(&key, "t"));
        assert_ne!(token_key(&key, "t"), token_key(&key, "u"));
        assert_ne!(token_key(&key, "t"), token_key(&other, "t"), "keyed");
        let rejected: Cache<TokenKey, ()> = Mutex::default();
        let ttl = Duration::from_secs(60);
        for i in 0..CACHE_CAPACITY + 10 {
            remember(&rejected, token_key(&key, &format!("bogus-{i}")), (), ttl);
        }
        assert_eq!(rejected.lock().unwrap().len(), CACHE_CAPACITY, "bounded");
        assert_eq!(cached(&rejected, &token_key(&key, "bogus-0")), Some(()));
        assert_eq!(cached(&rejected, &token_key(&key, "bogus-4100")), None);
        let brief: Cache<TokenKey, ()> = Mutex::default();
        remember(
            &brief,
            token_key(&key, "bogus"),
            (),
            Duration::from_millis(1),
        );
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(cached(&brief, &token_key(&key, "bogus")), None, "expired");
        // Once expired, room is made for new ones.
        let full: Cache<TokenKey, ()> = Mutex::default();
        for i in 0..CACHE_CAPACITY {
            remember(
                &full,
                token_key(&key, &format!("b{i}")),
                (),
                Duration::from_millis(1),
            );
        }
        std::thread::sleep(Duration::from_millis(5));
        remember(&full, token_key(&key, "new"), (), ttl);
        assert_eq!(full.lock().unwrap().len(), 1);
    }

    #[test]
    fn always_allowed_paths_match_as_upstream_matches_them() {
        let p: Vec<String> = ["/healthz", "readyz", "/debug/*"].map(String::from).into();
        for yes in ["/healthz", "/readyz", "/debug/pprof", "/debug/"] {
            assert!(path_allowed(&p, yes), "{yes}");
        }
        for no in ["/metrics", "/healthz/x", "/debug", "/livez"] {
            assert!(!path_allowed(&p, no), "{no}");
        }
        assert!(path_allowed(&["/".to_string()], "/"));
        assert!(check_allow_path("/debug/*").is_ok());
        assert!(check_allow_path("/de*bug").is_err());
    }
}
