package throttle_test

import (
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/rlagent/rlagent/limiter/throttle"
)

// A client whose backend refuses everything soon stops sending most of its
// requests: they fail locally with ErrThrottled.
func ExampleTransport() {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "overloaded", http.StatusTooManyRequests)
	}))
	defer backend.Close()

	th, err := throttle.New(throttle.Options{}) // K = 2, a 2-minute window
	if err != nil {
		log.Fatal(err)
	}
	client := &http.Client{Transport: &throttle.Transport{Throttle: th}}

	var sent, throttled int
	for range 200 {
		resp, err := client.Get(backend.URL)
		if errors.Is(err, throttle.ErrThrottled) {
			throttled++
			continue
		}
		if err != nil {
			log.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		sent++
	}
	fmt.Println("most requests throttled locally:", throttled > sent)
	// Output: most requests throttled locally: true
}

// Allow and Record wrap any kind of call: here, one that reports whether
// the backend took it.
func ExampleThrottle() {
	th, err := throttle.New(throttle.Options{K: 2, Window: time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	call := func() (accepted bool) { return true } // the backend's answer

	for range 10 {
		if !th.Allow() {
			continue // fail fast: the backend is refusing most requests
		}
		th.Record(call())
	}
	st := th.Stats()
	fmt.Printf("requests %.0f, accepts %.0f, reject probability %.0f\n", st.Requests, st.Accepts, st.RejectProbability)
	// Output: requests 10, accepts 10, reject probability 0
}
