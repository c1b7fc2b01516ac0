package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strings"
	"testing"
)

// The bash completion script of the built binary: bash sources it without
// error, it registers a completion for egressproxyctl, and it completes
// subcommands, nested subcommands and the values of -o.
func TestCompletionBash(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash on PATH")
	}
	bin := buildBinary(t)
	// complete_line runs the registered completion function on a command line
	// whose last word is being typed, as bash does on TAB.
	const script = `# The script relies on the bash-completion package, as every cobra
# program's does; where it is not installed, the one function of it the
# script calls is given here.
if [ -f /usr/share/bash-completion/bash_completion ]; then
	source /usr/share/bash-completion/bash_completion
else
	_get_comp_words_by_ref() {
		cur=${COMP_WORDS[COMP_CWORD]}; prev=${COMP_WORDS[COMP_CWORD-1]}; words=("${COMP_WORDS[@]}"); cword=$COMP_CWORD
	}
fi
source <("$BIN" completion bash) || exit 1
complete -p egressproxyctl || exit 1
# compopt works only inside a completion bash itself started (on TAB); it
# changes how the words are shown, not which.
compopt() { :; }
complete_line() {
	COMP_WORDS=("$BIN" "$@"); COMP_CWORD=$(($# )); COMP_LINE="$BIN $*"; COMP_POINT=${#COMP_LINE}; COMPREPLY=()
	__start_egressproxyctl
	printf '%s|' "${COMPREPLY[@]}"; echo
}
complete_line ""
complete_line i
complete_line images v
complete_line ls -o ""
complete_line help c
`
	cmd := exec.Command(bash, "--norc", "--noprofile", "-c", script)
	cmd.Env = append(os.Environ(), "BIN="+bin)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil || stderr.Len() > 0 {
		t.Fatalf("bash: %v\nstderr: %s\nstdout: %s", err, stderr.String(), out)
	}
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	if len(lines) != 6 {
		t.Fatalf("want the complete -p line and 5 completions, got:\n%s", out)
	}
	if !regexp.MustCompile(`^complete .*-F __start_egressproxyctl egressproxyctl$`).MatchString(lines[0]) {
		t.Errorf("complete -p egressproxyctl: %q", lines[0])
	}
	for i, want := range [][]string{
		{"check", "create", "delete", "gc", "images", "ls", "probe", "version", "completion", "help"},
		{"images"},
		{"verify"},
		{"table", "json", "yaml", "name"},
		{"check", "completion", "config", "create"},
	} {
		got := map[string]bool{}
		for _, w := range strings.Split(strings.TrimSuffix(lines[i+1], "|"), "|") {
			got[strings.TrimSpace(w)] = true
		}
		for _, w := range want {
			if !got[w] {
				t.Errorf("completion %d: %q lacks %q", i+1, lines[i+1], w)
			}
		}
		if len(got) != len(want) && i > 0 {
			t.Errorf("completion %d: %q, want exactly %q", i+1, lines[i+1], want)
		}
	}
}

// zsh and fish get scripts of their own shells.
func TestCompletionOtherShells(t *testing.T) {
	w := newWorld(t, "lab1")
	for shell, want := range map[string]string{"zsh": "#compdef egressproxyctl", "fish": "complete -c egressproxyctl"} {
		out, _ := w.want(exitOK, "completion", shell)
		if !strings.Contains(out, want) {
			t.Errorf("completion %s lacks %q", shell, want)
		}
	}
}

// version reports the module version and the toolchain the binary was
// built with, and a revision only as the toolchain recorded it.
func TestBinaryVersion(t *testing.T) {
	bin := buildBinary(t)
	out, err := exec.Command(bin, "version", "-o", "json").Output()
	if err != nil {
		t.Fatalf("version: %v", err)
	}
	var v versionInfo
	if err := json.Unmarshal(out, &v); err != nil {
		t.Fatalf("version -o json: %v: %s", err, out)
	}
	if v.Version != "(devel)" || v.GoVersion != runtime.Version() {
		t.Errorf("version %+v, want (devel) built with %s", v, runtime.Version())
	}
	if v.Revision != "" && !regexp.MustCompile(`^[0-9a-f]{40}$`).MatchString(v.Revision) {
		t.Errorf("revision %q is not a commit hash", v.Revision)
	}
	t.Logf("version: %s", strings.TrimSpace(string(out)))
}
