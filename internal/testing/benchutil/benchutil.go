package benchutil

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// LoadEnv reads the stack's environment (`eval "$(scripts/teststack env)"`),
// naming every missing variable.
func LoadEnv() (teststack.Env, error) {
	var missing []string
	str := func(k string) string {
		v := os.Getenv(k)
		if v == "" {
			missing = append(missing, k)
		}
		return v
	}
	env := teststack.Env{
		Dir:           str(teststack.VarDir),
		Script:        str(teststack.VarScript),
		SSHAddr:       str(teststack.VarSSHAddr),
		SSHUser:       str(teststack.VarSSHUser),
		UnprivUser:    str(teststack.VarUnprivUser),
		SSHKey:        str(teststack.VarSSHKey),
		KnownHosts:    str(teststack.VarKnownHosts),
		LibvirtSocket: str(teststack.VarLibvirtSocket),
		LibvirtURI:    str(teststack.VarLibvirtURI),
		Pool:          str(teststack.VarPool),
		PoolPath:      str(teststack.VarPoolPath),
		SquidAddr:     str(teststack.VarSquidAddr),
		SquidAuthAddr: str(teststack.VarSquidAuthAddr),
		SquidUser:     str(teststack.VarSquidUser),
		SquidPassword: str(teststack.VarSquidPassword),
	}
	port := str(teststack.VarSquidDeniedPort)
	if len(missing) > 0 {
		return teststack.Env{}, fmt.Errorf("stack environment incomplete, unset: %s (run scripts/teststack up, then eval \"$(scripts/teststack env)\")", strings.Join(missing, ", "))
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return teststack.Env{}, fmt.Errorf("%s=%q: %w", teststack.VarSquidDeniedPort, port, err)
	}
	env.SquidDeniedPort = p
	return env, nil
}

// Median returns the median of xs (the mean of the two middle values for an
// even count), 0 for none.
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// Ratios returns a[i]/b[i] for the paired runs i (runs where b is 0 are
// skipped). a and b must come from interleaved runs (A B A B …) so drift
// cancels within each pair.
func Ratios(a, b []float64) []float64 {
	var out []float64
	for i := range min(len(a), len(b)) {
		if b[i] != 0 {
			out = append(out, a[i]/b[i])
		}
	}
	return out
}

// MBps is bytes per second in MB/s (10^6 bytes).
func MBps(bytes int64, seconds float64) float64 {
	if seconds <= 0 {
		return 0
	}
	return float64(bytes) / seconds / 1e6
}
