// Package httplimit is net/http middleware that rate limits requests with
// a [limiter.Set]: each request draws one token from every limit of the
// Set, all or nothing, with keys that [KeyFunc]s take from the request
// (the client's address or network, a header).
//
// A limit's policy decides what an empty bucket does: a "fail" limit
// refuses at once, a "wait" limit holds the request until its token
// accrues, for no longer than the limit's MaxWait and the request's
// context. A refused request gets 429 Too Many Requests and Retry-After,
// and never reaches the handler.
//
// # Fields
//
// Responses carry the RateLimit-Policy and RateLimit fields of the IETF
// draft named by [DraftRevision] (by default on every response; see
// [HeaderMode]), one List member per configured limit, named by the
// limit's name as a quoted String:
//
//	RateLimit-Policy: "per-client";q=100;w=10, "global";q=2000;w=1
//	RateLimit: "per-client";r=0;t=1, "global";r=1500;t=1
//
// q and w are the limit's quota per window: w its burst's refill time
// (burst / rate) in whole seconds, at least 1; q what the limit admits in
// w at its rate, never less than its burst. r is the tokens now left to
// the request's key, t the seconds until the next one accrues (absent
// while the bucket is full). A 429's Retry-After is no earlier than the t
// of any limit with r=0. The partition key parameter (pk) is not sent:
// the keys are clients' addresses and headers, not the server's to echo.
//
// # Lifetime and concurrency
//
// The middleware holds the Set and the Options; it is safe for concurrent
// use, has no goroutine and nothing to close. Limits follow the Limiter's
// configuration as it changes (see package limiter): a limit not yet
// configured admits and is left out of the fields.
package httplimit
