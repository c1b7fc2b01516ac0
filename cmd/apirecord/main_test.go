package main

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"go/types"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// check type-checks src (one file per package path, in import order) and
// returns the packages.
func check(t *testing.T, srcs [][2]string) map[string]*types.Package {
	t.Helper()
	fset := token.NewFileSet()
	pkgs := map[string]*types.Package{}
	imp := importerFunc(func(path string) (*types.Package, error) {
		if p, ok := pkgs[path]; ok {
			return p, nil
		}
		return nil, fmt.Errorf("no package %s", path)
	})
	for _, s := range srcs {
		f, err := parser.ParseFile(fset, s[0]+"/x.go", s[1], 0)
		if err != nil {
			t.Fatal(err)
		}
		p, err := (&types.Config{Importer: imp}).Check(s[0], fset, []*ast.File{f}, nil)
		if err != nil {
			t.Fatal(err)
		}
		pkgs[s[0]] = p
	}
	return pkgs
}

type importerFunc func(string) (*types.Package, error)

func (f importerFunc) Import(path string) (*types.Package, error) { return f(path) }

func TestLines(t *testing.T) {
	t.Parallel()
	pkgs := check(t, [][2]string{
		{"example.org/other", `package other
type Conn interface{ Close() error }
`},
		{"example.com/m/internal/errs", `package errs
type Code int
func (c Code) String() string { return "" }
type FieldError struct { Field string; rule string }
func (e *FieldError) Error() string { return e.Field }
type Leaked struct{}
`},
		{"example.com/m", `package m
import (
	"example.com/m/internal/errs"
	"example.org/other"
)
type Code = errs.Code
type FieldError = errs.FieldError
const OK = errs.Code(0)
const Name = "m"
var ErrX error
func Leak() errs.Leaked { return errs.Leaked{} }
func F(c other.Conn, names ...string) (n int, err error) { return 0, nil }
func Errs(err error) []*FieldError { return nil }
type Reader interface { Read(p []byte) (int, error); close() }
type base struct { Promoted string }
func (base) Hello(name string) string { return name }
type Ref struct{ Name string }
type T struct { base; Ref; Cb func(x int) (y string); hidden int }
func (t *T) Set(v int) {}
type Same = Ref
type Gen[P any] struct{ V P }
`},
		{"example.com/m/sub", `package sub
import "example.com/m"
func Code(err error) m.Code { return 0 }
type S struct{ F *m.FieldError }
`},
	})
	got := lines("example.com/m", []*types.Package{pkgs["example.com/m"], pkgs["example.com/m/sub"]})
	want := []string{
		`const Name untyped string = "m"`,
		`const OK Code = 0`,
		`func Errs(error) []*FieldError`,
		`func F(other.Conn, ...string) (int, error)`,
		`func Leak() internal/errs.Leaked`,
		`method (*FieldError) Error() string`,
		`method (*T) Set(int)`,
		`method (Code) String() string`,
		`method (T) Hello(string) string`,
		`type Code int`,
		`type FieldError struct`,
		`type FieldError struct, Field string`,
		`type Gen[P any] struct`,
		`type Gen[P any] struct, V P`,
		`type Reader interface { Read, unexported methods }`,
		`type Reader interface, Read([]byte) (int, error)`,
		`type Ref struct`,
		`type Ref struct, Name string`,
		`type Same = Ref`,
		`type T struct`,
		`type T struct, Cb func(int) string`,
		`type T struct, Promoted string`,
		`type T struct, embedded Ref`,
		`var ErrX error`,
	}
	for i := range want {
		want[i] = "pkg example.com/m, " + want[i]
	}
	want = append(want,
		"pkg example.com/m/sub, func Code(error) m.Code",
		"pkg example.com/m/sub, type S struct",
		"pkg example.com/m/sub, type S struct, F *m.FieldError",
	)
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("lines (-want +got):\n%s", d)
	}
}

func TestShipped(t *testing.T) {
	t.Parallel()
	mod := &struct{ Path string }{"example.com/m"}
	for _, tt := range []struct {
		p    listed
		want bool
	}{
		{listed{ImportPath: "example.com/m", Name: "m", Module: mod}, true},
		{listed{ImportPath: "example.com/m/kvm2", Name: "kvm2", Module: mod}, true},
		{listed{ImportPath: "example.com/m/driver/drivertest", Name: "drivertest", Module: mod}, true},
		{listed{ImportPath: "example.com/m/internal/errs", Name: "errs", Module: mod}, false},
		{listed{ImportPath: "example.com/m/a/internal/b", Name: "b", Module: mod}, false},
		{listed{ImportPath: "example.com/m/internalx", Name: "internalx", Module: mod}, true},
		{listed{ImportPath: "example.com/m/cmd/bench", Name: "main", Module: mod}, false},
		{listed{ImportPath: "example.com/m/cmd/lib", Name: "lib", Module: mod}, false},
		{listed{ImportPath: "example.com/m/examples/x", Name: "x", Module: mod}, false},
		{listed{ImportPath: "example.com/m/e2e", Name: "e2e", Module: mod}, false},
		{listed{ImportPath: "example.com/m/tool", Name: "main", Module: mod}, false},
		{listed{ImportPath: "example.org/dep", Name: "dep", Module: &struct{ Path string }{"example.org/dep"}}, false},
		{listed{ImportPath: "strings", Name: "strings", Standard: true}, false},
	} {
		if got := shipped(tt.p, "example.com/m"); got != tt.want {
			t.Errorf("shipped(%s) = %v, want %v", tt.p.ImportPath, got, tt.want)
		}
	}
}
