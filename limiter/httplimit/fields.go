package httplimit

import (
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/rlagent/rlagent/limiter"
)

// DraftRevision is the revision of the IETF draft "RateLimit header fields
// for HTTP" whose RateLimit and RateLimit-Policy fields this package sends.
const DraftRevision = "draft-ietf-httpapi-ratelimit-headers-10"

// The fields' names. Field names are case-insensitive; net/http writes
// these canonical forms ("Ratelimit-Policy" on HTTP/1.1).
const (
	FieldRateLimit       = "RateLimit"
	FieldRateLimitPolicy = "RateLimit-Policy"
)

// maxSFInteger is the largest Integer a Structured Field can carry
// (RFC 9651 section 3.3.1: at most 15 digits).
const maxSFInteger = 999_999_999_999_999

// policy is a limit's quota policy, as RateLimit-Policy advertises it:
// q requests per w seconds.
//
// The draft's quota is a count per window; a limit here is a rate with a
// burst (GCRA). The window is the burst's refill time, Quota / Rate,
// rounded up to whole seconds (the draft has no sub-second windows), and
// the quota is what the limit admits in that window at its rate, and never
// less than the burst: q = max(burst, floor(rate × w)). So q/w is the
// rate, rounded down, and q what may go at once when the bucket is full.
func policy(s limiter.Status) (q, w int64) {
	w = ceilSeconds(s.Window)
	if w < 1 {
		w = 1
	}
	q = s.Quota
	if byRate := math.Floor(s.Rate * float64(w)); byRate > float64(q) {
		q = int64(min(byRate, maxSFInteger))
	}
	return min(q, maxSFInteger), min(w, maxSFInteger)
}

// service is a limit's current service limit, as RateLimit reports it: r
// units remaining, more in t seconds. hasT is false when the bucket is
// full: no quota is on its way, and the draft's t ("the number of seconds
// until additional quota ... is made available") has no value to give.
//
// t is the time until the next token, not until the bucket is full: a
// bucket that lacks tokens gains one every 1/Rate, and the draft asks that
// t and a 429's Retry-After name the same moment when the client is out
// of quota. Status.Reset is when the bucket is full; the next token comes
// (Quota - Remaining - 1) tokens' time earlier.
func service(s limiter.Status) (r, t int64, hasT bool) {
	r = min(max(s.Remaining, 0), maxSFInteger)
	if s.Remaining >= s.Quota || s.Reset <= 0 {
		return r, 0, false
	}
	next := s.Reset
	if missing := s.Quota - max(s.Remaining, 0); missing > 1 && s.Rate > 0 {
		next -= time.Duration(float64(missing-1) / s.Rate * float64(time.Second))
	}
	next = min(max(next, 0), s.Reset)
	return r, min(ceilSeconds(next), maxSFInteger), true
}

// ceilSeconds is d in whole seconds, rounded up.
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Second - 1) / time.Second)
}

// setFields sets the RateLimit-Policy and RateLimit fields of h for the
// limits in sts, one List member per limit, in the Set's order. A limit
// with no quota (not yet configured) is left out; with none left, h is
// unchanged.
func setFields(h http.Header, sts []limiter.Status) {
	var pol, cur []byte
	for _, s := range sts {
		if s.Quota <= 0 || s.Rate <= 0 {
			continue
		}
		if len(pol) > 0 {
			pol = append(pol, ", "...)
			cur = append(cur, ", "...)
		}
		q, w := policy(s)
		pol = appendSFString(pol, s.Limit)
		pol = append(pol, ";q="...)
		pol = strconv.AppendInt(pol, q, 10)
		pol = append(pol, ";w="...)
		pol = strconv.AppendInt(pol, w, 10)

		r, t, hasT := service(s)
		cur = appendSFString(cur, s.Limit)
		cur = append(cur, ";r="...)
		cur = strconv.AppendInt(cur, r, 10)
		if hasT {
			cur = append(cur, ";t="...)
			cur = strconv.AppendInt(cur, t, 10)
		}
	}
	if len(pol) == 0 {
		return
	}
	h.Set(FieldRateLimitPolicy, string(pol))
	h.Set(FieldRateLimit, string(cur))
}

// appendSFString appends s as a Structured Field String (RFC 9651 section
// 3.3.3): in double quotes, with " and \ escaped. A String holds printable
// ASCII only; any other byte of a limit's name is sent as '?', so that the
// field stays valid whatever the name.
func appendSFString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20 || c > 0x7e:
			b = append(b, '?')
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}
