package httplimit

import (
	"fmt"
	"strconv"
)

// A small parser of the Structured Fields (RFC 9651) this package sends:
// a List of Items whose bare items are Strings (or Tokens) and whose
// parameters are Integers. It follows RFC 9651 section 4.2's parsing
// algorithm for those types and fails on anything else, so a field it
// accepts is valid per the draft's ABNF.

type sfParam struct {
	key   string
	value int64
}

type sfItem struct {
	value    string
	isString bool // else a Token
	params   []sfParam
}

func (it sfItem) param(key string) (int64, bool) {
	for _, p := range it.params {
		if p.key == key {
			return p.value, true
		}
	}
	return 0, false
}

type sfParser struct {
	s string
	i int
}

// parseSFList parses a List field value (RFC 9651 section 4.2.1).
func parseSFList(s string) ([]sfItem, error) {
	p := &sfParser{s: s}
	p.skipSP()
	var items []sfItem
	for p.i < len(p.s) {
		it, err := p.item()
		if err != nil {
			return nil, err
		}
		items = append(items, it)
		p.skipOWS()
		if p.i == len(p.s) {
			return items, nil
		}
		if p.s[p.i] != ',' {
			return nil, fmt.Errorf("at %d: want ',' after a list member, got %q", p.i, p.s[p.i])
		}
		p.i++
		p.skipOWS()
		if p.i == len(p.s) {
			return nil, fmt.Errorf("trailing comma")
		}
	}
	if len(items) == 0 {
		return nil, fmt.Errorf("empty list")
	}
	return items, nil
}

func (p *sfParser) skipSP() {
	for p.i < len(p.s) && p.s[p.i] == ' ' {
		p.i++
	}
}

func (p *sfParser) skipOWS() {
	for p.i < len(p.s) && (p.s[p.i] == ' ' || p.s[p.i] == '\t') {
		p.i++
	}
}

func (p *sfParser) item() (sfItem, error) {
	var it sfItem
	if p.i >= len(p.s) {
		return it, fmt.Errorf("at %d: want an item", p.i)
	}
	switch c := p.s[p.i]; {
	case c == '"':
		v, err := p.str()
		if err != nil {
			return it, err
		}
		it.value, it.isString = v, true
	case isAlpha(c) || c == '*':
		it.value = p.token()
	default:
		return it, fmt.Errorf("at %d: want a String or a Token, got %q", p.i, c)
	}
	for p.i < len(p.s) && p.s[p.i] == ';' {
		p.i++
		p.skipSP()
		k, err := p.key()
		if err != nil {
			return it, err
		}
		if p.i >= len(p.s) || p.s[p.i] != '=' {
			return it, fmt.Errorf("parameter %q: want =Integer (this package sends no Boolean)", k)
		}
		p.i++
		v, err := p.integer()
		if err != nil {
			return it, fmt.Errorf("parameter %q: %w", k, err)
		}
		for _, q := range it.params {
			if q.key == k {
				return it, fmt.Errorf("parameter %q twice", k)
			}
		}
		it.params = append(it.params, sfParam{k, v})
	}
	return it, nil
}

// str parses a String (RFC 9651 section 4.2.5).
func (p *sfParser) str() (string, error) {
	p.i++ // the opening DQUOTE
	var b []byte
	for p.i < len(p.s) {
		c := p.s[p.i]
		p.i++
		switch {
		case c == '\\':
			if p.i >= len(p.s) {
				return "", fmt.Errorf("string ends in an escape")
			}
			n := p.s[p.i]
			p.i++
			if n != '"' && n != '\\' {
				return "", fmt.Errorf("escape of %q", n)
			}
			b = append(b, n)
		case c == '"':
			return string(b), nil
		case c < 0x20 || c > 0x7e:
			return "", fmt.Errorf("byte %#x in a string", c)
		default:
			b = append(b, c)
		}
	}
	return "", fmt.Errorf("unterminated string")
}

// token parses a Token (RFC 9651 section 4.2.6).
func (p *sfParser) token() string {
	start := p.i
	p.i++
	for p.i < len(p.s) && (isTchar(p.s[p.i]) || p.s[p.i] == ':' || p.s[p.i] == '/') {
		p.i++
	}
	return p.s[start:p.i]
}

// key parses a key (RFC 9651 section 4.2.3.3).
func (p *sfParser) key() (string, error) {
	start := p.i
	if p.i >= len(p.s) || !(isLower(p.s[p.i]) || p.s[p.i] == '*') {
		return "", fmt.Errorf("at %d: a key starts with lcalpha or *", p.i)
	}
	for p.i < len(p.s) {
		c := p.s[p.i]
		if !(isLower(c) || isDigit(c) || c == '_' || c == '-' || c == '.' || c == '*') {
			break
		}
		p.i++
	}
	return p.s[start:p.i], nil
}

// integer parses an Integer (RFC 9651 section 4.2.4, no Decimal).
func (p *sfParser) integer() (int64, error) {
	start := p.i
	if p.i < len(p.s) && p.s[p.i] == '-' {
		p.i++
	}
	digits := p.i
	for p.i < len(p.s) && isDigit(p.s[p.i]) {
		p.i++
	}
	if n := p.i - digits; n == 0 || n > 15 {
		return 0, fmt.Errorf("at %d: an Integer has 1 to 15 digits", start)
	}
	if p.i < len(p.s) && p.s[p.i] == '.' {
		return 0, fmt.Errorf("at %d: a Decimal, want an Integer", start)
	}
	return strconv.ParseInt(p.s[start:p.i], 10, 64)
}

func isAlpha(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
func isLower(c byte) bool { return c >= 'a' && c <= 'z' }
func isDigit(c byte) bool { return c >= '0' && c <= '9' }
func isTchar(c byte) bool {
	return isAlpha(c) || isDigit(c) || c != 0 && c < 0x7f && c > 0x20 && stringsContainsByte("!#$%&'*+-.^_`|~", c)
}

func stringsContainsByte(s string, c byte) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == c {
			return true
		}
	}
	return false
}

// checkFields parses a response's RateLimit-Policy and RateLimit values
// and checks them against the draft: both non-empty Lists; a policy item
// is a String with a non-negative q and a positive w; a service limit item
// names a policy, with a non-negative r and, if present, a non-negative t.
// It returns the items.
func checkFields(policy, current string) (pol, cur []sfItem, err error) {
	if pol, err = parseSFList(policy); err != nil {
		return nil, nil, fmt.Errorf("RateLimit-Policy %q: %w", policy, err)
	}
	if cur, err = parseSFList(current); err != nil {
		return nil, nil, fmt.Errorf("RateLimit %q: %w", current, err)
	}
	names := map[string]bool{}
	for _, it := range pol {
		if !it.isString {
			return nil, nil, fmt.Errorf("policy %s: the draft wants a String", it.value)
		}
		if q, ok := it.param("q"); !ok || q < 0 {
			return nil, nil, fmt.Errorf("policy %q: q missing or negative", it.value)
		}
		if w, ok := it.param("w"); ok && w <= 0 {
			return nil, nil, fmt.Errorf("policy %q: w %d not positive", it.value, w)
		}
		names[it.value] = true
	}
	for _, it := range cur {
		if !it.isString {
			return nil, nil, fmt.Errorf("service limit %s: the draft wants a String", it.value)
		}
		if !names[it.value] {
			return nil, nil, fmt.Errorf("RateLimit names %q, not in RateLimit-Policy", it.value)
		}
		if r, ok := it.param("r"); !ok || r < 0 {
			return nil, nil, fmt.Errorf("service limit %q: r missing or negative", it.value)
		}
		if t, ok := it.param("t"); ok && t < 0 {
			return nil, nil, fmt.Errorf("service limit %q: t negative", it.value)
		}
	}
	return pol, cur, nil
}
