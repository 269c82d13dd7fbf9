from lockstep.scheduler.server import main

main()
