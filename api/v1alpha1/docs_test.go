package v1alpha1

import (
	"os"
	"reflect"
	"strings"
	"testing"
)

// TestDocs keeps docs/config.md true: its example parses, its invalid
// example fails with exactly the errors shown, and every field has a row.
func TestDocs(t *testing.T) {
	data, err := os.ReadFile("../../docs/config.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(data)
	// block returns the fenced block that follows marker.
	block := func(marker string) string {
		t.Helper()
		_, after, ok := strings.Cut(doc, marker)
		if !ok {
			t.Fatalf("docs/config.md has no %q", marker)
		}
		_, after, _ = strings.Cut(after, "```")
		_, after, _ = strings.Cut(after, "\n") // the fence's info string
		body, _, _ := strings.Cut(after, "```")
		return body
	}

	c, err := ParseConfig([]byte(block("<!-- example config -->")))
	if err != nil {
		t.Errorf("the example config: %v", err)
	} else if len(c.Limits) != 3 || c.Limits[0].EffectiveBurst() != 2000 {
		t.Errorf("the example config parses as %+v", c)
	}

	_, err = ParseConfig([]byte(block("<!-- invalid config -->")))
	if err == nil {
		t.Fatal("the invalid example config is valid")
	}
	if got, want := wrap("load config rlagent.yaml", err).Error(), strings.TrimSpace(block("<!-- its errors -->")); got != want {
		t.Errorf("the invalid example's errors are\n%s\nand the doc says\n%s", got, want)
	}

	for _, typ := range []reflect.Type{
		reflect.TypeFor[Config](), reflect.TypeFor[CountSource](), reflect.TypeFor[Limit](),
		reflect.TypeFor[Match](), reflect.TypeFor[PrefixLength](),
	} {
		names, _ := jsonFields(typ)
		for _, n := range names {
			if !strings.Contains(doc, "\n| `"+n+"` |") {
				t.Errorf("docs/config.md has no row for %s.%s", typ.Name(), n)
			}
		}
	}
}
