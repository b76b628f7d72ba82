// Package grpclimit applies rlagent's in-process limits to gRPC: server
// interceptors that draw from a [limiter.Set] for every call, and client
// interceptors that throttle calls to an overloaded backend locally, with
// Google SRE's client-side adaptive throttling ([throttle.Throttle]).
//
// It is the only package of the library that imports gRPC: an application
// that serves net/http alone imports limiter and limiter/httplimit, and
// links none of it.
//
// # Server
//
// [UnaryServerInterceptor] and [StreamServerInterceptor] compute the key
// of each limit of the Set from the call ([Options].Keys: [PeerIP],
// [Metadata], [FullMethod] or a function of your own) and call [limiter.Set.Wait], so
// each limit's policy decides:
//
//   - A limit with OnEmpty "fail" refuses an over-limit call at once with
//     codes.ResourceExhausted. The status message names the limit, and
//     the status carries a google.rpc.RetryInfo detail whose retry_delay
//     is the time the draw could succeed; the trailer
//     grpc-retry-pushback-ms says the same to gRPC's own retry policy
//     (gRFC A6), so that a client configured to retry RESOURCE_EXHAUSTED
//     comes back when a token is there rather than after its backoff.
//   - A limit with OnEmpty "wait" holds the call until its token accrues,
//     and then runs it. A call that would wait longer than the limit's
//     MaxWait, or past its own deadline, fails at once as above, without
//     waiting. A call cancelled while it waits ends with codes.Canceled
//     or codes.DeadlineExceeded, and gives its tokens back.
//
// A rejected call reaches neither the handler nor the other limits of the
// Set: the draw is all or nothing.
//
// A stream is charged one token when it opens, whatever it then sends,
// unless [Options].PerMessage is set: then the stream's open is free and each
// message the server receives costs one token (a rejection is returned by
// the stream's RecvMsg, and the handler returns it as usual).
//
// # Client
//
// [UnaryClientInterceptor] and [StreamClientInterceptor] ask the Throttle
// before each call. A call the Throttle refuses fails at once, without
// reaching the server, with codes.Unavailable and an error that matches
// [throttle.ErrThrottled] with errors.Is. Every call that went out is
// recorded as [Classify] says: codes.ResourceExhausted and
// codes.Unavailable (which is also what a refused or broken connection
// gives) are rejections; codes.Canceled and codes.DeadlineExceeded are not
// recorded (the call's context ended: that says nothing of the server);
// every other outcome, application errors included, is an acceptance.
//
// # Concurrency
//
// The interceptors are safe for concurrent use, as are the Set and the
// Throttle they are given; they keep no state of their own beyond the
// options.
package grpclimit
