// Package labfile holds what the lab's small commands (delayproxy,
// labmirror) share: the files they tell scripts/lab their state through.
package labfile
