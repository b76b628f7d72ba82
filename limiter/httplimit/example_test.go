package httplimit_test

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"time"

	"github.com/rlagent/rlagent/limiter"
	"github.com/rlagent/rlagent/limiter/httplimit"
)

// A handler behind a per-client limit: each client address may send 2
// requests at once, then 1 every 10 seconds; the third request at once is
// refused with 429.
func ExampleNew() {
	l, err := limiter.New(limiter.Options{})
	if err != nil {
		log.Fatal(err)
	}
	err = l.Apply([]limiter.LimitConfig{
		{Name: "per-client", Rate: 0.1, Burst: 2, Keyed: true, OnEmpty: limiter.OnEmptyFail},
	})
	if err != nil {
		log.Fatal(err)
	}

	hello := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "hello\n")
	})
	mw := httplimit.New(l.Set("per-client"), httplimit.Options{
		Keys: []httplimit.KeyFunc{httplimit.ClientIP},
	})
	srv := httptest.NewServer(mw(hello)) // with chi: r.Use(mw)
	defer srv.Close()

	var policy string
	for range 3 {
		resp, err := http.Get(srv.URL)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
		policy = resp.Header.Get("RateLimit-Policy")
		fmt.Print(resp.StatusCode, " RateLimit: ", resp.Header.Get("RateLimit"))
		if ra := resp.Header.Get("Retry-After"); ra != "" {
			fmt.Print(" Retry-After: ", ra)
		}
		fmt.Println()
	}
	fmt.Println("RateLimit-Policy:", policy)
	// Output:
	// 200 RateLimit: "per-client";r=1;t=10
	// 200 RateLimit: "per-client";r=0;t=10
	// 429 RateLimit: "per-client";r=0;t=10 Retry-After: 10
	// RateLimit-Policy: "per-client";q=2;w=20
}

// Behind a load balancer, key by the client it forwards for, believing
// X-Forwarded-For only from the balancer's own network, and give each IPv4
// /24 and IPv6 /64 one bucket.
func ExampleClient() {
	key := httplimit.Client(httplimit.ClientOptions{
		V4Bits:         24,
		V6Bits:         64,
		TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
	})

	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = "10.1.2.3:41000" // the balancer
	r.Header.Set("X-Forwarded-For", "198.51.100.23")
	fmt.Println(key(r))

	r.RemoteAddr = "203.0.113.9:41000" // not the balancer: its header is not believed
	fmt.Println(key(r))
	// Output:
	// 198.51.100.0/24
	// 203.0.113.0/24
}

// Two limits on one request, all or nothing: one per API key, waiting up
// to its MaxWait when empty, and one for the whole service.
func ExampleOptions() {
	l, err := limiter.New(limiter.Options{})
	if err != nil {
		log.Fatal(err)
	}
	err = l.Apply([]limiter.LimitConfig{
		{Name: "per-key", Rate: 10, Burst: 20, Keyed: true, OnEmpty: limiter.OnEmptyWait, MaxWait: 500 * time.Millisecond},
		{Name: "service", Rate: 1000, Burst: 1000},
	})
	if err != nil {
		log.Fatal(err)
	}
	mw := httplimit.New(l.Set("per-key", "service"), httplimit.Options{
		Keys:    []httplimit.KeyFunc{httplimit.Header("X-Api-Key"), nil}, // "service" is key-less
		Headers: httplimit.HeadersOnRejected,
	})
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {})))
	defer srv.Close()

	req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
	req.Header.Set("X-Api-Key", "alice")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		log.Fatal(err)
	}
	resp.Body.Close()
	fmt.Println(resp.StatusCode, resp.Header.Get("RateLimit") == "")
	// Output: 200 true
}
