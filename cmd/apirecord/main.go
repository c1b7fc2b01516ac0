// Command apirecord prints the exported API of the module's shipped
// packages, one line per exported identifier, sorted, in the manner of the
// Go project's api/ files:
//
//	pkg github.com/egressproxy/egressproxy, func Code(error) ErrorCode
//	pkg github.com/egressproxy/egressproxy, method (*Client) Close() error
//	pkg github.com/egressproxy/egressproxy, type Spec struct
//	pkg github.com/egressproxy/egressproxy, type Spec struct, Name string
//
// A shipped package is one a user can import: not main, not internal, not
// under examples/, cmd/ or e2e/. Each gets its types (with their kind), the
// fields of its structs (embedded ones as "embedded T"), the methods of its
// interfaces, the methods of its other types (promoted ones included,
// receiver as the method set has it), its funcs with their signatures, and
// its constants (type and value) and variables (type). Test files are not
// read. An alias of a type of an internal package is recorded as the type
// it stands for, under the alias's name, since that is all a user sees of
// it; other types of internal packages, which no exported signature should
// name, are printed with their module-relative path so they stand out.
//
// Usage, from the module root:
//
//	go run ./cmd/apirecord [-o api/v0.txt] [packages]
//
// packages defaults to ./... . The packages are loaded from the compiler's
// export data (go list -export), so apirecord needs only the go command and
// the module cache: it runs offline (GOPROXY=off) once the modules are
// downloaded. make api writes api/v0.txt; make api-check compares.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"go/constant"
	"go/importer"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
)

func main() {
	out := flag.String("o", "", "write the record to `file` instead of standard output")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: apirecord [-o file] [packages]\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	patterns := flag.Args()
	if len(patterns) == 0 {
		patterns = []string{"./..."}
	}
	rec, err := record(patterns)
	if err != nil {
		fmt.Fprintln(os.Stderr, "apirecord:", err)
		os.Exit(1)
	}
	text := strings.Join(rec, "\n") + "\n"
	if *out == "" {
		_, err = io.WriteString(os.Stdout, text)
	} else {
		err = os.WriteFile(*out, []byte(text), 0o644)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "apirecord:", err)
		os.Exit(1)
	}
}

// listed is the part of go list's JSON that apirecord reads.
type listed struct {
	ImportPath string
	Name       string
	Export     string
	Standard   bool
	Module     *struct{ Path string }
	Error      *struct{ Err string }
}

// goList runs go list -json with args and decodes its stream of packages.
func goList(args ...string) ([]listed, error) {
	cmd := exec.Command("go", append([]string{"list", "-json=ImportPath,Name,Export,Standard,Module,Error"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	b, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list %s: %v\n%s", strings.Join(args, " "), err, stderr.Bytes())
	}
	var pkgs []listed
	for dec := json.NewDecoder(bytes.NewReader(b)); ; {
		var p listed
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			return pkgs, nil
		} else if err != nil {
			return nil, fmt.Errorf("go list: %v", err)
		}
		if p.Error != nil {
			return nil, fmt.Errorf("go list: %s: %s", p.ImportPath, p.Error.Err)
		}
		pkgs = append(pkgs, p)
	}
}

// shipped reports whether a package of module modPath is one users import.
func shipped(p listed, modPath string) bool {
	if p.Standard || p.Module == nil || p.Module.Path != modPath || p.Name == "main" {
		return false
	}
	rel := strings.TrimPrefix(strings.TrimPrefix(p.ImportPath, modPath), "/")
	for _, elem := range strings.Split(rel, "/") {
		if elem == "internal" {
			return false
		}
	}
	first, _, _ := strings.Cut(rel, "/")
	return first != "examples" && first != "cmd" && first != "e2e"
}

// record loads the shipped packages among patterns and returns their lines,
// sorted.
func record(patterns []string) ([]string, error) {
	mod, err := exec.Command("go", "list", "-m").Output()
	if err != nil {
		return nil, fmt.Errorf("go list -m: %v", err)
	}
	modPath := strings.TrimSpace(string(mod))
	all, err := goList(append([]string{"-deps", "-export"}, patterns...)...)
	if err != nil {
		return nil, err
	}
	exports := make(map[string]string, len(all))
	var targets []string
	for _, p := range all {
		exports[p.ImportPath] = p.Export
		if shipped(p, modPath) {
			targets = append(targets, p.ImportPath)
		}
	}
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		f, ok := exports[path]
		if !ok || f == "" {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(f)
	})
	var pkgs []*types.Package
	for _, path := range targets {
		pkg, err := imp.Import(path)
		if err != nil {
			return nil, fmt.Errorf("import %s: %v", path, err)
		}
		pkgs = append(pkgs, pkg)
	}
	return lines(modPath, pkgs), nil
}

// lines returns the record of pkgs, packages of module modPath, sorted.
func lines(modPath string, pkgs []*types.Package) []string {
	r := &recorder{
		modPath: modPath,
		public:  map[string]string{},
		// A name qualified by the path of a package of the module, as
		// typeString's qualifier prints it.
		qualified: regexp.MustCompile(regexp.QuoteMeta(modPath) + `(?:/[A-Za-z0-9_-]+)*\.[A-Za-z_][A-Za-z0-9_]*`),
	}
	for _, pkg := range pkgs {
		r.noteAliases(pkg)
	}
	for _, pkg := range pkgs {
		r.pkg(pkg)
	}
	slices.Sort(r.lines)
	return slices.Compact(r.lines)
}

type recorder struct {
	modPath string
	// public maps "path.Name" of a type of an internal package to the
	// shipped alias users know it by ("github.com/…/egressproxy.ErrorCode").
	public    map[string]string
	qualified *regexp.Regexp
	lines     []string
	// cur is the package being recorded; its own names print unqualified.
	cur *types.Package
}

func (r *recorder) internal(pkg *types.Package) bool {
	return pkg != nil && strings.HasPrefix(pkg.Path(), r.modPath+"/") &&
		slices.Contains(strings.Split(strings.TrimPrefix(pkg.Path(), r.modPath+"/"), "/"), "internal")
}

// noteAliases records the shipped aliases of pkg that stand for types of
// internal packages.
func (r *recorder) noteAliases(pkg *types.Package) {
	for _, name := range pkg.Scope().Names() {
		tn, ok := pkg.Scope().Lookup(name).(*types.TypeName)
		if !ok || !tn.Exported() || !tn.IsAlias() {
			continue
		}
		if n, ok := types.Unalias(tn.Type()).(*types.Named); ok && r.internal(n.Obj().Pkg()) {
			r.public[n.Obj().Pkg().Path()+"."+n.Obj().Name()] = pkg.Path() + "." + name
		}
	}
}

// typeString prints t as the current package's code would name it: its own
// names bare, other packages by name, a type of an internal package by its
// shipped alias (or, when there is none, its module-relative path).
func (r *recorder) typeString(t types.Type) string {
	s := types.TypeString(unnamed(t), func(p *types.Package) string {
		switch {
		case p == r.cur:
			return ""
		case p.Path() == r.modPath || strings.HasPrefix(p.Path(), r.modPath+"/"):
			return p.Path()
		default:
			return p.Name()
		}
	})
	return r.qualified.ReplaceAllStringFunc(s, func(q string) string {
		if pub, ok := r.public[q]; ok {
			q = pub
		}
		dot := strings.LastIndex(q, ".")
		path, name := q[:dot], q[dot+1:]
		switch {
		case path == r.cur.Path():
			return name
		case r.internal(types.NewPackage(path, "")):
			return strings.TrimPrefix(path, r.modPath+"/") + "." + name
		default:
			return path[strings.LastIndex(path, "/")+1:] + "." + name
		}
	})
}

func (r *recorder) add(format string, args ...any) {
	r.lines = append(r.lines, "pkg "+r.cur.Path()+", "+fmt.Sprintf(format, args...))
}

func (r *recorder) pkg(pkg *types.Package) {
	r.cur = pkg
	scope := pkg.Scope()
	for _, name := range scope.Names() {
		obj := scope.Lookup(name)
		if !obj.Exported() {
			continue
		}
		switch obj := obj.(type) {
		case *types.Const:
			r.add("const %s %s = %s", name, r.typeString(obj.Type()), constString(obj.Val()))
		case *types.Var:
			r.add("var %s %s", name, r.typeString(obj.Type()))
		case *types.Func:
			r.add("func %s%s", name, r.signature(obj.Type().(*types.Signature)))
		case *types.TypeName:
			r.typeName(name, obj)
		}
	}
}

// unnamed returns t with the parameters and results of every func type in
// it unnamed: a parameter's name is not part of the API.
func unnamed(t types.Type) types.Type {
	switch t := t.(type) {
	case *types.Pointer:
		return types.NewPointer(unnamed(t.Elem()))
	case *types.Slice:
		return types.NewSlice(unnamed(t.Elem()))
	case *types.Array:
		return types.NewArray(unnamed(t.Elem()), t.Len())
	case *types.Map:
		return types.NewMap(unnamed(t.Key()), unnamed(t.Elem()))
	case *types.Chan:
		return types.NewChan(t.Dir(), unnamed(t.Elem()))
	case *types.Struct:
		fields := make([]*types.Var, t.NumFields())
		tags := make([]string, t.NumFields())
		for i := range t.NumFields() {
			f := t.Field(i)
			fields[i] = types.NewField(f.Pos(), f.Pkg(), f.Name(), unnamed(f.Type()), f.Embedded())
			tags[i] = t.Tag(i)
		}
		return types.NewStruct(fields, tags)
	case *types.Signature:
		tuple := func(tu *types.Tuple) *types.Tuple {
			vars := make([]*types.Var, tu.Len())
			for i := range tu.Len() {
				vars[i] = types.NewParam(tu.At(i).Pos(), tu.At(i).Pkg(), "", unnamed(tu.At(i).Type()))
			}
			return types.NewTuple(vars...)
		}
		return types.NewSignatureType(nil, nil, nil, tuple(t.Params()), tuple(t.Results()), t.Variadic())
	}
	// Named types, aliases, basic types and type parameters print by name;
	// anonymous interfaces keep their method signatures as declared.
	return t
}

func constString(v constant.Value) string {
	if v.Kind() == constant.String {
		return v.String() // quoted, as Go writes it
	}
	return v.ExactString()
}

// signature prints sig without the func keyword: "(string, int) error".
func (r *recorder) signature(sig *types.Signature) string {
	return strings.TrimPrefix(r.typeString(sig), "func")
}

func (r *recorder) typeName(name string, tn *types.TypeName) {
	t := tn.Type()
	if tn.IsAlias() {
		n, ok := types.Unalias(t).(*types.Named)
		if !ok || !r.internal(n.Obj().Pkg()) {
			r.add("type %s = %s", name, r.typeString(types.Unalias(t)))
			return
		}
		// An alias of an internal type: the type under this name.
		t = n
	}
	named, _ := t.(*types.Named)
	head := "type " + name
	if named != nil && named.TypeParams().Len() > 0 {
		var ps []string
		for i := range named.TypeParams().Len() {
			tp := named.TypeParams().At(i)
			ps = append(ps, tp.Obj().Name()+" "+r.typeString(tp.Constraint()))
		}
		head += "[" + strings.Join(ps, ", ") + "]"
	}
	switch u := t.Underlying().(type) {
	case *types.Struct:
		r.add("%s struct", head)
		r.fields(head+" struct", u)
	case *types.Interface:
		var names []string
		unexported := false
		for m := range u.Methods() {
			if m.Exported() {
				names = append(names, m.Name())
				r.add("%s interface, %s%s", head, m.Name(), r.signature(m.Type().(*types.Signature)))
			} else {
				unexported = true
			}
		}
		if unexported {
			names = append(names, "unexported methods")
		}
		r.add("%s interface { %s }", head, strings.Join(names, ", "))
		return
	default:
		r.add("%s %s", head, r.typeString(u))
	}
	r.methods(name, t)
}

// fields records the exported fields of st. The exported fields of an
// embedded struct that is not itself recorded (unexported, or of an
// internal package) are promoted into head, since only there a user sees
// them.
func (r *recorder) fields(head string, st *types.Struct) {
	for f := range st.Fields() {
		if f.Embedded() {
			et := f.Type()
			if p, ok := et.(*types.Pointer); ok {
				et = p.Elem()
			}
			n, _ := types.Unalias(et).(*types.Named)
			hidden := n != nil && (!n.Obj().Exported() || r.internal(n.Obj().Pkg()))
			if f.Exported() && !hidden {
				r.add("%s, embedded %s", head, r.typeString(f.Type()))
			}
			if inner, ok := et.Underlying().(*types.Struct); ok && hidden {
				r.fields(head, inner)
			}
			continue
		}
		if f.Exported() {
			r.add("%s, %s %s", head, f.Name(), r.typeString(f.Type()))
		}
	}
}

// methods records the exported methods of the non-interface type t named
// name, promoted ones included: (T) for the value method set, (*T) for the
// rest.
func (r *recorder) methods(name string, t types.Type) {
	value := types.NewMethodSet(t)
	for sel := range types.NewMethodSet(types.NewPointer(t)).Methods() {
		m := sel.Obj().(*types.Func)
		if !m.Exported() {
			continue
		}
		recv := "*" + name
		if value.Lookup(m.Pkg(), m.Name()) != nil {
			recv = name
		}
		r.add("method (%s) %s%s", recv, m.Name(), r.signature(m.Type().(*types.Signature)))
	}
}
