package maps

import (
	"strings"
	"testing"
)

// A value of each enum has a name (String, from the names tables) exactly
// when Validate accepts it: a value the C side and Validate gained without
// a name, or a name for a value the data path does not take, fails here.
func TestEnumNames(t *testing.T) {
	valid := Limit{Rate: 10, Burst: 10, Match: Match{Protocol: TCP}}
	for x := range 256 {
		v := uint8(x)
		for _, c := range []struct {
			kind string
			name string
			set  func(*Limit)
		}{
			{"unit", Unit(v).String(), func(l *Limit) { l.Unit = Unit(v) }},
			{"action", Action(v).String(), func(l *Limit) { l.Action = Action(v) }},
			{"key", KeyKind(v).String(), func(l *Limit) { l.Key = KeyKind(v) }},
			{"protocol", Protocol(v).String(), func(l *Limit) { l.Match.Protocol = Protocol(v) }},
			{"attach", Attach(v).String(), func(l *Limit) { l.Match.Attach = Attach(v) }},
			{"direction", Direction(v).String(), func(l *Limit) { l.Match.Direction = Direction(v) }},
		} {
			l := valid
			c.set(&l)
			err := l.Validate()
			accepted := err == nil || !strings.Contains(err.Error(), "is not one of")
			named := !strings.HasPrefix(c.name, c.kind+"(")
			if accepted != named {
				t.Errorf("%s %d: named %q, Validate: %v", c.kind, v, c.name, err)
			}
		}
	}
	for h := range NumHooks {
		if name := Hook(h).String(); strings.HasPrefix(name, "hook(") {
			t.Errorf("hook %d has no name", h)
		}
	}
	if name := Hook(NumHooks).String(); !strings.HasPrefix(name, "hook(") {
		t.Errorf("hook %d (past the last) is named %q", NumHooks, name)
	}
}
