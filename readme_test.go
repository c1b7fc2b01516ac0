package egressproxy_test

import (
	"go/ast"
	"go/format"
	"go/parser"
	"go/token"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestREADMEProgram: the README's first program is Example_gettingStarted
// word for word — the same imports, main's body is the example's body, and
// the output the README shows is the example's // Output: — and it is
// gofmt-formatted Go. go test compiles and runs the example, so the README
// cannot show a program that does not compile or prints something else.
func TestREADMEProgram(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	prog, shown := readmeProgram(t, string(readme))
	if formatted, err := format.Source([]byte(prog)); err != nil {
		t.Fatalf("the README's program is not Go: %v", err)
	} else if string(formatted) != prog {
		t.Errorf("the README's program is not gofmt-formatted; gofmt gives:\n%s", formatted)
	}
	example, err := os.ReadFile("example_readme_test.go")
	if err != nil {
		t.Fatal(err)
	}
	progImports, progBody := funcBody(t, "README.md", prog, "main")
	exImports, exBody := funcBody(t, "example_readme_test.go", string(example), "Example_gettingStarted")
	exBody, exOutput, ok := strings.Cut(exBody, "\t// Output:\n")
	if !ok {
		t.Fatal("Example_gettingStarted has no // Output:")
	}
	if !slices.Equal(progImports, exImports) {
		t.Errorf("the README's program imports %q, Example_gettingStarted's file %q", progImports, exImports)
	}
	if progBody != exBody {
		t.Errorf("the README's main differs from Example_gettingStarted:\n--- README.md\n%s\n--- example_readme_test.go\n%s", progBody, exBody)
	}
	var want []string
	for _, l := range strings.Split(strings.TrimRight(exOutput, "\n"), "\n") {
		want = append(want, strings.TrimPrefix(strings.TrimPrefix(l, "\t//"), " "))
	}
	if got := strings.Split(shown, "\n"); !slices.Equal(got, want) {
		t.Errorf("the README shows the output\n%s\nExample_gettingStarted prints\n%s", shown, strings.Join(want, "\n"))
	}
}

// readmeProgram returns the README's first ```go block that is a main
// package and the ```text block after it (what the program prints).
func readmeProgram(t *testing.T, readme string) (prog, output string) {
	t.Helper()
	_, rest, ok := strings.Cut(readme, "\n```go\npackage main\n")
	if !ok {
		t.Fatal("README.md has no ```go block that starts with package main")
	}
	prog, rest, ok = strings.Cut(rest, "\n```\n")
	if !ok {
		t.Fatal("README.md: the program's ```go block is not closed")
	}
	_, rest, ok = strings.Cut(rest, "\n```text\n")
	if !ok {
		t.Fatal("README.md: no ```text block with the output after the program")
	}
	output, _, ok = strings.Cut(rest, "\n```")
	if !ok {
		t.Fatal("README.md: the output's ```text block is not closed")
	}
	return "package main\n" + prog + "\n", output
}

// funcBody parses src and returns its import paths and the text between
// the braces of its function name.
func funcBody(t *testing.T, file, src, name string) (imports []string, body string) {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, file, src, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	for _, imp := range f.Imports {
		path, err := strconv.Unquote(imp.Path.Value)
		if err != nil {
			t.Fatal(err)
		}
		imports = append(imports, path)
	}
	for _, d := range f.Decls {
		if fn, ok := d.(*ast.FuncDecl); ok && fn.Name.Name == name && fn.Body != nil {
			return imports, src[fset.Position(fn.Body.Lbrace).Offset+1 : fset.Position(fn.Body.Rbrace).Offset]
		}
	}
	t.Fatalf("%s has no func %s", file, name)
	return nil, ""
}
