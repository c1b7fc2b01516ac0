package kvm2

import (
	"os"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/sshconn"
)

// docsConfig returns docs/config.md and its first ```yaml block.
func docsConfig(t *testing.T) (doc, example string) {
	t.Helper()
	b, err := os.ReadFile("../docs/config.md")
	if err != nil {
		t.Fatal(err)
	}
	doc = string(b)
	_, rest, ok := strings.Cut(doc, "\n```yaml\n")
	if !ok {
		t.Fatal("docs/config.md has no ```yaml block")
	}
	example, _, ok = strings.Cut(rest, "\n```\n")
	if !ok {
		t.Fatal("docs/config.md: the ```yaml block is not closed")
	}
	return doc, example + "\n"
}

// The example of docs/config.md is a valid entry with every field (a field
// left out because it excludes another one is there as a comment), and
// the field tables list every key: the page cannot rot.
func TestDocsConfigExample(t *testing.T) {
	t.Parallel()
	doc, example := docsConfig(t)
	c, err := ParseConfig([]byte(example))
	if err != nil {
		t.Fatalf("the example of docs/config.md does not parse and validate:\n%v", err)
	}
	p, err := open(t.Context(), c, nil)
	if err != nil {
		t.Fatalf("open(example): %v", err)
	}
	p.Close()
	for _, typ := range []reflect.Type{reflect.TypeFor[Config](), reflect.TypeFor[imagecache.Image](), reflect.TypeFor[MachineType]()} {
		names, _ := jsonFields(typ)
		for name, goName := range names {
			if !regexp.MustCompile(`(?m)^\s*(# )?` + name + `:|[{ ]` + name + `: `).MatchString(example) {
				t.Errorf("the example of docs/config.md lacks %s (%s.%s)", name, typ.Name(), goName)
			}
			if !strings.Contains(doc, "| `"+name+"` | `"+goName+"` |") {
				t.Errorf("the field tables of docs/config.md lack a row for %s (%s.%s)", name, typ.Name(), goName)
			}
		}
	}
	// The config structs of sshconn are listed by key.
	for _, typ := range []reflect.Type{
		reflect.TypeFor[sshconn.Config]()} {
		names, _ := jsonFields(typ)
		for name := range names {
			if !strings.Contains(doc, "`"+name+"`") {
				t.Errorf("docs/config.md does not mention %s.%s", typ, name)
			}
		}
	}
}
