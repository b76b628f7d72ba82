package v1alpha1

import (
	"io/fs"
	"os"
	"path/filepath"
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

// TestReadmeLayout keeps the README's layout table whole: every top-level
// folder that holds Go code has a row (a new package is found there).
func TestReadmeLayout(t *testing.T) {
	data, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(data)
	entries, err := os.ReadDir("../..")
	if err != nil {
		t.Fatal(err)
	}
	found := 0
	for _, e := range entries {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") || e.Name() == "bin" {
			continue
		}
		if !holdsGo(t, "../../"+e.Name()) {
			continue
		}
		found++
		if !strings.Contains(readme, "\n| `"+e.Name()+"/") {
			t.Errorf("README.md's layout table has no row for %s/", e.Name())
		}
	}
	if found < 10 {
		t.Errorf("found %d folders with Go code: the walk is wrong", found)
	}
}

// holdsGo reports whether a .go file lies anywhere under dir.
func holdsGo(t *testing.T, dir string) bool {
	t.Helper()
	var found bool
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || found {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(path, ".go") {
			found = true
			return fs.SkipAll
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}
