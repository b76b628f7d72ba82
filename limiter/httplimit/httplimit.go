package httplimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/rlagent/rlagent/limiter"
)

// HeaderMode says which responses carry the RateLimit and
// RateLimit-Policy fields.
type HeaderMode int

const (
	// HeadersAlways sends them on every response: admitted ones (the
	// state after the request's draw) and refused ones.
	HeadersAlways HeaderMode = iota
	// HeadersOnRejected sends them on refused responses only.
	HeadersOnRejected
	// HeadersNever sends neither (a 429 still has Retry-After).
	HeadersNever
)

// Options configure the middleware. The zero value keys every limit by ""
// (right for key-less limits), answers 429 with the draft's fields, and
// sends the fields on every response.
type Options struct {
	// Keys are the requests' keys: Keys[i] keys the Set's i-th limit
	// (see limiter.Set.Names). A nil KeyFunc, or one past the end, gives
	// "" (a key-less limit ignores its key). (Optional) More KeyFuncs
	// than the Set has limits is an error (New panics).
	Keys []KeyFunc
	// OnRejected writes the response to a request the limits refused.
	// When it is called, the fields and Retry-After are already in
	// w.Header(). err is a *limiter.RejectedError (errors.As), or, if
	// the request's context ended while it waited, the context's error.
	// (Optional) nil means DefaultOnRejected.
	OnRejected func(w http.ResponseWriter, r *http.Request, err error)
	// Headers says which responses carry the RateLimit fields.
	// (Optional) The zero value is HeadersAlways.
	Headers HeaderMode
}

// New returns middleware that admits a request when every limit of set
// admits it, with set.Wait(r.Context(), keys...): each limit's policy
// decides. A limit that fails refuses at once; a limit that waits holds
// the request until its tokens accrue (no longer than the limit's
// MaxWait, nor than the request's context: a wait that cannot end in time
// refuses at once). A refused request gets 429 Too Many Requests with
// Retry-After, from OnRejected, and never reaches next.
//
// The middleware has the shape of chi's, gorilla/mux's and alice's:
// r.Use(httplimit.New(set, opts)). It panics if set is nil or opts has
// more Keys than set has limits: both are mistakes in the program.
func New(set *limiter.Set, opts Options) func(http.Handler) http.Handler {
	if set == nil {
		panic("httplimit: nil *limiter.Set")
	}
	if n := len(set.Names()); len(opts.Keys) > n {
		panic(fmt.Sprintf("httplimit: %d Keys for a Set of %d limits %q", len(opts.Keys), n, set.Names()))
	}
	m := &middleware{
		set:        set,
		keys:       append([]KeyFunc(nil), opts.Keys...),
		onRejected: opts.OnRejected,
		headers:    opts.Headers,
	}
	if m.onRejected == nil {
		m.onRejected = DefaultOnRejected
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			m.serve(w, r, next)
		})
	}
}

type middleware struct {
	set        *limiter.Set
	keys       []KeyFunc
	onRejected func(http.ResponseWriter, *http.Request, error)
	headers    HeaderMode
}

// statusBuf sizes the per-request buffers: a Set of up to this many
// limits needs no allocation for them.
const statusBuf = 4

func (m *middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	var kb [statusBuf]string
	keys := kb[:0]
	for _, f := range m.keys {
		k := ""
		if f != nil {
			k = f(r)
		}
		keys = append(keys, k)
	}
	err := m.set.Wait(r.Context(), keys...)
	if err == nil {
		if m.headers == HeadersAlways {
			var sb [statusBuf]limiter.Status
			setFields(w.Header(), m.set.Status(sb[:0], keys...))
		}
		next.ServeHTTP(w, r)
		return
	}
	var rej *limiter.RejectedError
	if errors.As(err, &rej) {
		h := w.Header()
		var sb [statusBuf]limiter.Status
		sts := m.set.Status(sb[:0], keys...)
		if m.headers != HeadersNever {
			setFields(h, sts)
		}
		h.Set("Retry-After", strconv.FormatInt(retryAfter(rej, sts, m.headers != HeadersNever), 10))
	}
	m.onRejected(w, r, err)
}

// retryAfter is a refused request's Retry-After, in whole seconds: the
// refusing limit's RetryAfter rounded up, at least 1 (the core gives 0
// when it cannot say, as for a request larger than the burst). With the
// RateLimit field sent, it is also no earlier than the t of any limit with
// nothing remaining, as the draft asks ("the Retry-After field value
// SHOULD NOT reference a point in time earlier than the reset parameter"):
// such a limit would refuse the retry too. A limit with quota left does
// not hold the retry back, whatever its t.
func retryAfter(rej *limiter.RejectedError, sts []limiter.Status, fields bool) int64 {
	secs := max(1, ceilSeconds(rej.RetryAfter))
	if !fields {
		return secs
	}
	for _, s := range sts {
		if s.Quota <= 0 || s.Rate <= 0 {
			continue
		}
		if r, t, hasT := service(s); r == 0 && hasT {
			secs = max(secs, t)
		}
	}
	return secs
}

// ProblemQuotaExceeded is the problem type DefaultOnRejected answers with,
// the one the draft defines for a request over a quota policy.
const ProblemQuotaExceeded = "https://iana.org/assignments/http-problem-types#quota-exceeded"

// DefaultOnRejected answers a refused request. For a *limiter.RejectedError:
// 429 Too Many Requests, with an RFC 9457 problem of the draft's
// "quota-exceeded" type naming the refusing limit in "violated-policies".
// For any other error (the request's context ended while it waited: the
// client is gone, or a deadline passed): 503 Service Unavailable.
func DefaultOnRejected(w http.ResponseWriter, r *http.Request, err error) {
	var rej *limiter.RejectedError
	if !errors.As(err, &rej) {
		http.Error(w, "request ended while waiting for its rate limit", http.StatusServiceUnavailable)
		return
	}
	body, _ := json.Marshal(struct {
		Type     string   `json:"type"`
		Title    string   `json:"title"`
		Violated []string `json:"violated-policies"`
	}{
		Type:     ProblemQuotaExceeded,
		Title:    "Quota Exceeded",
		Violated: []string{rej.Limit},
	})
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusTooManyRequests)
	w.Write(append(body, '\n'))
}
