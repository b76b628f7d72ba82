package agent

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// The reviews' answers are kept for as long as controller-runtime's
// metrics filter and the kubelet keep theirs: a token the API server
// accepted for a minute, one it rejected for 10 s, an allowed review for
// 5 min, a denied one for 30 s (a binding just made counts within 30 s,
// one removed within 5 min). Each cache holds at most reviewCacheSize
// answers, so that a stranger sending new tokens cannot grow the agent;
// the client's rate limit (client-go's default: 5 requests per second,
// bursts of 10) bounds what it makes the API server do.
const (
	tokenTTL        = time.Minute
	tokenFailTTL    = 10 * time.Second
	allowedTTL      = 5 * time.Minute
	deniedTTL       = 30 * time.Second
	reviewCacheSize = 1024
	reviewTimeout   = 10 * time.Second
)

// reviewer asks the API server about each scrape of the secure listener:
// who the bearer token belongs to (a TokenReview), and whether that user
// may get the non-resource URL /metrics (a SubjectAccessReview). It does
// what controller-runtime's filters.WithAuthenticationAndAuthorization and
// kube-rbac-proxy do, with client-go's typed clients alone: that filter
// brings k8s.io/apiserver with it, which took the agent's RSS from 46 to 76
// MiB (over the 64 MiB of TestScale) and its binary from 50 to 92 MB, for a
// listener that is off by default.
type reviewer struct {
	client kubernetes.Interface
	log    *slog.Logger
	tokens cache[authnv1.UserInfo]
	access cache[bool]
}

func newReviewer(kube *rest.Config, log *slog.Logger) (*reviewer, error) {
	c, err := kubernetes.NewForConfig(kube)
	if err != nil {
		return nil, fmt.Errorf("secure metrics: API server client: %w", err)
	}
	return &reviewer{client: c, log: log}, nil
}

// guard answers 401 to a request without a bearer token or with one the
// API server does not accept (or that it could not be asked about), 403 to
// a user it does not allow to get the path, 503 when that could not be
// asked, and passes the others to next.
func (rv *reviewer) guard(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || token == "" {
			http.Error(w, "Unauthorized", http.StatusUnauthorized)
			return
		}
		log := rv.log.With("remote", r.RemoteAddr)
		user, ok := rv.authenticate(r.Context(), token, log)
		if !ok {
			http.Error(w, "Unauthorized", http.StatusUnauthorized)
			return
		}
		allowed, err := rv.authorize(r.Context(), user, r.URL.Path)
		switch {
		case err != nil:
			log.Warn("secure metrics: access review failed; answering 503", "user", user.Username, "error", err)
			http.Error(w, "Service Unavailable", http.StatusServiceUnavailable)
		case !allowed:
			log.Debug("secure metrics: not allowed to get "+r.URL.Path+" (403)", "user", user.Username)
			http.Error(w, "Forbidden", http.StatusForbidden)
		default:
			next.ServeHTTP(w, r)
		}
	})
}

// authenticate returns the user of token, and whether the API server
// accepted it. A review that fails (the API server unreachable) is a
// rejection, not remembered.
func (rv *reviewer) authenticate(ctx context.Context, token string, log *slog.Logger) (authnv1.UserInfo, bool) {
	sum := sha256.Sum256([]byte(token))
	key := string(sum[:])
	if u, ok, found := rv.tokens.get(key); found {
		return u, ok
	}
	ctx, cancel := context.WithTimeout(ctx, reviewTimeout)
	defer cancel()
	tr, err := rv.client.AuthenticationV1().TokenReviews().Create(ctx,
		&authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token}}, metav1.CreateOptions{})
	if err != nil {
		log.Warn("secure metrics: token review failed; answering 401", "error", err)
		return authnv1.UserInfo{}, false
	}
	if !tr.Status.Authenticated {
		log.Debug("secure metrics: token not accepted (401)", "error", tr.Status.Error)
		rv.tokens.put(key, authnv1.UserInfo{}, false, tokenFailTTL)
		return authnv1.UserInfo{}, false
	}
	rv.tokens.put(key, tr.Status.User, true, tokenTTL)
	return tr.Status.User, true
}

// authorize says whether user may get the non-resource URL path.
func (rv *reviewer) authorize(ctx context.Context, user authnv1.UserInfo, path string) (bool, error) {
	key := fmt.Sprintf("%q %q %q %q", user.Username, user.UID, user.Groups, path)
	if _, ok, found := rv.access.get(key); found {
		return ok, nil
	}
	extra := make(map[string]authzv1.ExtraValue, len(user.Extra))
	for k, v := range user.Extra {
		extra[k] = authzv1.ExtraValue(v)
	}
	ctx, cancel := context.WithTimeout(ctx, reviewTimeout)
	defer cancel()
	sar, err := rv.client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authzv1.SubjectAccessReview{
		Spec: authzv1.SubjectAccessReviewSpec{
			User: user.Username, UID: user.UID, Groups: user.Groups, Extra: extra,
			NonResourceAttributes: &authzv1.NonResourceAttributes{Path: path, Verb: "get"},
		}}, metav1.CreateOptions{})
	if err != nil {
		return false, err
	}
	ttl := deniedTTL
	if sar.Status.Allowed {
		ttl = allowedTTL
	}
	rv.access.put(key, true, sar.Status.Allowed, ttl)
	return sar.Status.Allowed, nil
}

// cache is a map of answers that expire, of at most reviewCacheSize: a
// full one drops the expired answers, then any.
type cache[V any] struct {
	mu sync.Mutex
	m  map[string]cached[V]
}

type cached[V any] struct {
	v       V
	ok      bool
	expires time.Time
}

func (c *cache[V]) get(key string) (v V, ok, found bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, found := c.m[key]
	if !found || time.Now().After(e.expires) {
		return v, false, false
	}
	return e.v, e.ok, true
}

func (c *cache[V]) put(key string, v V, ok bool, ttl time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = make(map[string]cached[V])
	}
	if len(c.m) >= reviewCacheSize {
		now := time.Now()
		for k, e := range c.m {
			if now.After(e.expires) {
				delete(c.m, k)
			}
		}
		for k := range c.m {
			if len(c.m) < reviewCacheSize {
				break
			}
			delete(c.m, k)
		}
	}
	c.m[key] = cached[V]{v: v, ok: ok, expires: time.Now().Add(ttl)}
}
