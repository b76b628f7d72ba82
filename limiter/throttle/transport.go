package throttle

import (
	"errors"
	"fmt"
	"net"
	"net/http"
)

// Outcome is what a request's answer tells the throttle.
type Outcome int

const (
	// Ignored: the answer says nothing of the backend (the caller
	// cancelled the request, a name did not resolve...). Not recorded.
	Ignored Outcome = iota
	// Accepted: the backend took the request (Record(true)).
	Accepted
	// Rejected: the backend refused it (Record(false)).
	Rejected
)

func (o Outcome) String() string {
	switch o {
	case Ignored:
		return "ignored"
	case Accepted:
		return "accepted"
	case Rejected:
		return "rejected"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Classify is the default classification of a round trip's result:
//
//   - a 429 (Too Many Requests) or 503 (Service Unavailable) response:
//     Rejected;
//   - any other response: Accepted, 5xx included (the backend did the
//     work, or tried);
//   - a connection refused or reset while connecting (ECONNREFUSED,
//     ECONNRESET; what a SYN answered by a TCP RST gives, as rlagent's
//     kernel `action: reject` does): Rejected;
//   - any other error (the request's context ended, a timeout, a name that
//     did not resolve, a connection broken after it was made): Ignored,
//     since it does not show that the backend refused the work.
func Classify(resp *http.Response, err error) Outcome {
	if err == nil {
		if resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable {
			return Rejected
		}
		return Accepted
	}
	if refusedAtConnect(err) {
		return Rejected
	}
	return Ignored
}

// refusedAtConnect reports whether err is a connection refused, or reset,
// while dialing.
func refusedAtConnect(err error) bool {
	var op *net.OpError
	if !errors.As(err, &op) || op.Op != "dial" {
		return false
	}
	return isRefused(op.Err)
}

// Transport is an http.RoundTripper that throttles the requests it sends
// with a Throttle: a request the throttle refuses fails at once, with an
// error matching ErrThrottled, and never reaches the backend; every other
// request goes to Base and its result is recorded as Classify says.
//
// Share one Transport (one Throttle) per backend: the throttle's point is
// to learn one backend's state from all the requests sent to it.
type Transport struct {
	// Throttle decides and counts. (Required)
	Throttle *Throttle
	// Base sends the requests the throttle allows. (Optional) nil means
	// http.DefaultTransport.
	Base http.RoundTripper
	// Classify tells the throttle what a round trip's result means.
	// (Optional) nil means the package's Classify.
	Classify func(*http.Response, error) Outcome
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if !t.Throttle.Allow() {
		// A RoundTripper must close the body, even on an error.
		if req.Body != nil {
			req.Body.Close()
		}
		// ErrThrottled itself: http.Client already names the method and
		// URL, and a refusal then costs no allocation.
		return nil, ErrThrottled
	}
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	resp, err := base.RoundTrip(req)
	classify := t.Classify
	if classify == nil {
		classify = Classify
	}
	switch classify(resp, err) {
	case Accepted:
		t.Throttle.Record(true)
	case Rejected:
		t.Throttle.Record(false)
	}
	return resp, err
}
