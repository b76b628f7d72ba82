package throttle

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
)

func TestClassify(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	reset := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNRESET)}
	resetLater := &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ECONNRESET)}
	for _, tc := range []struct {
		name   string
		status int
		err    error
		want   Outcome
	}{
		{name: "200", status: 200, want: Accepted},
		{name: "404", status: 404, want: Accepted},
		{name: "500", status: 500, want: Accepted},
		{name: "429", status: 429, want: Rejected},
		{name: "503", status: 503, want: Rejected},
		{name: "refused at connect", err: fmt.Errorf("wrapped: %w", refused), want: Rejected},
		{name: "reset at connect", err: reset, want: Rejected},
		{name: "reset after connect", err: resetLater, want: Ignored},
		{name: "cancelled", err: context.Canceled, want: Ignored},
		{name: "deadline", err: context.DeadlineExceeded, want: Ignored},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var resp *http.Response
			if tc.err == nil {
				resp = &http.Response{StatusCode: tc.status}
			}
			if got := Classify(resp, tc.err); got != tc.want {
				t.Fatalf("Classify = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestTransportRefusedConnection: a real refused connection on loopback is
// recorded as a rejection.
func TestTransportRefusedConnection(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens: the kernel answers the SYN with a RST

	th := mustNew(t, Options{})
	client := &http.Client{Transport: &Transport{Throttle: th, Base: &http.Transport{}}}
	_, err = client.Get("http://" + addr + "/")
	if err == nil {
		t.Fatal("a request to a closed port succeeded")
	}
	if !refusedAtConnect(err) {
		t.Fatalf("error %v is not a refused connect", err)
	}
	if st := th.Stats(); st.Requests != 1 || st.Accepts != 0 {
		t.Fatalf("counts = %v/%v, want 1/0 (a rejection)", st.Requests, st.Accepts)
	}
}

// closeTracker is a request body that remembers being closed.
type closeTracker struct {
	io.Reader
	closed atomic.Bool
}

func (c *closeTracker) Close() error { c.closed.Store(true); return nil }

// TestTransportThrottledLocally: a refused request fails with ErrThrottled,
// never reaches the server, and has its body closed.
func TestTransportThrottledLocally(t *testing.T) {
	var reached atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reached.Add(1)
	}))
	defer srv.Close()

	clk := newFakeClock()
	th := mustNew(t, Options{Now: clk.Now, Rand: fixedRand(0)})
	record(th, 100, 0) // p = 100/101; a draw of 0 refuses

	body := &closeTracker{Reader: strings.NewReader("x")}
	req, err := http.NewRequest(http.MethodPost, srv.URL, body)
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: &Transport{Throttle: th, Base: srv.Client().Transport}}
	_, err = client.Do(req)
	if !errors.Is(err, ErrThrottled) {
		t.Fatalf("error %v is not ErrThrottled", err)
	}
	if reached.Load() != 0 {
		t.Fatal("a throttled request reached the server")
	}
	if !body.closed.Load() {
		t.Fatal("the throttled request's body was not closed")
	}
	if st := th.Stats(); st.Requests != 101 || st.Accepts != 0 {
		t.Fatalf("counts = %v/%v, want 101/0", st.Requests, st.Accepts)
	}
}

// TestTransportRecords: 429 and 503 are rejections, other answers accepts,
// a cancelled request is not counted.
func TestTransportRecords(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/429":
			w.WriteHeader(http.StatusTooManyRequests)
		case "/503":
			w.WriteHeader(http.StatusServiceUnavailable)
		case "/500":
			w.WriteHeader(http.StatusInternalServerError)
		}
	}))
	defer srv.Close()

	th := mustNew(t, Options{})
	client := &http.Client{Transport: &Transport{Throttle: th, Base: srv.Client().Transport}}
	for _, path := range []string{"/", "/500", "/429", "/503"} {
		resp, err := client.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
	if _, err := client.Do(req); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled request: error %v", err)
	}
	if st := th.Stats(); st.Requests != 4 || st.Accepts != 2 {
		t.Fatalf("counts = %v/%v, want 4/2", st.Requests, st.Accepts)
	}
}
