package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"sigs.k8s.io/yaml"
)

// listing is what a command prints, in every output format: the document
// (-o json and yaml: the same keys), the table for people (-o table) and
// the names (-o name: one per line, ENTRY/NAME for an instance, which
// delete and probe take back).
type listing struct {
	doc    any
	header []string
	rows   [][]string
	names  []string
}

// print writes l on stdout in the format -o asked for.
func (c *cli) print(l listing) error {
	switch c.g.output {
	case outputJSON:
		enc := json.NewEncoder(c.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(l.doc)
	case outputYAML:
		b, err := yaml.Marshal(l.doc)
		if err != nil {
			return err
		}
		_, err = c.stdout.Write(b)
		return err
	case outputName:
		for _, n := range l.names {
			fmt.Fprintln(c.stdout, n)
		}
		return nil
	}
	c.printTable(l.header, l.rows)
	return nil
}

// printTable writes a table for people on stdout: a header (unless
// --no-headers) and rows, columns aligned, "-" for empty cells.
func (c *cli) printTable(header []string, rows [][]string) {
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	if !c.g.noHeaders {
		fmt.Fprintln(tw, strings.Join(header, "\t"))
	}
	for _, r := range rows {
		cells := make([]string, len(r))
		for i, s := range r {
			if s == "" {
				s = "-"
			}
			cells[i] = oneLine(s)
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t"))
	}
	tw.Flush()
}

// oneLine keeps a cell on one line: tabs and newlines would break the table.
func oneLine(s string) string {
	return strings.NewReplacer("\t", " ", "\r", " ", "\n", " ").Replace(s)
}

// note writes a line for people on stderr (never on stdout, which carries
// the command's output).
func (c *cli) note(format string, args ...any) {
	fmt.Fprintf(c.stderr, format+"\n", args...)
}

// progress shows "label… 12s" on stderr, updated every second, while a long
// call runs, when stderr is a terminal; label may change as the call
// advances (set it with the returned function). stop removes the line and
// returns only after the updating goroutine has ended.
func (c *cli) progress(label string) (set func(string), stop func()) {
	if !c.tty {
		return func(string) {}, func() {}
	}
	var mu sync.Mutex
	start := time.Now()
	draw := func() {
		mu.Lock()
		defer mu.Unlock()
		fetch := c.fetchProgress()
		if fetch != "" {
			fetch = " — " + fetch
		}
		fmt.Fprintf(c.stderr, "\r\033[K%s… %s%s", label, time.Since(start).Round(time.Second), fetch)
	}
	draw()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				draw()
			}
		}
	}()
	set = func(l string) {
		mu.Lock()
		label = l
		mu.Unlock()
		draw()
	}
	stop = func() {
		close(done)
		wg.Wait()
		fmt.Fprint(c.stderr, "\r\033[K")
	}
	return set, stop
}

// age formats how long before now t was, for tables.
func age(now, t time.Time) string {
	if t.IsZero() {
		return ""
	}
	d := now.Sub(t)
	switch {
	case d < 0:
		return "0s"
	case d < time.Minute:
		return d.Round(time.Second).String()
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
