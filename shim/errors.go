package shim

import "fmt"

func errRole(got, want Role) error {
	return fmt.Errorf("config: role %q given to the %s constructor", got, want)
}
